"""Does every runtime dependency have a wheel for Linux arm64 and macOS arm64? Checked in the
package index, at the versions installed here (the ones the tests run).

    python benchmarks/check_platform_wheels.py [--extras backend] [--python-version 3.11]

The tree is clairvoyant's own requirements (the default ones and ``--extras``), followed through
the installed distributions' metadata. A distribution installed from a pure-Python wheel
(``py3-none-any``) runs anywhere; for every other one, ``pip download --no-deps --only-binary
:all:`` asks the index for a wheel of that version for each platform, into a temporary folder
deleted at once. It prints one row per platform-specific distribution, and exits 1 if any has no
wheel. Needs the package index (not run by ``make test``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = {  # pip --platform tags: the oldest glibc / macOS each wheel may ask for, newest last
    "Linux arm64": ["manylinux2014_aarch64", "manylinux_2_28_aarch64", "manylinux_2_34_aarch64"],
    "macOS arm64": ["macosx_11_0_arm64", "macosx_14_0_arm64", "macosx_15_0_arm64"],
}


def project_requirements(extras: list[str]) -> list[Requirement]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return wanted


def installed_tree(roots: list[Requirement]) -> dict[str, metadata.Distribution]:
    """Every installed distribution the roots need, with the extras each is asked for."""
    found: dict[str, tuple[metadata.Distribution, set[str]]] = {}
    todo = [(r, set(r.extras)) for r in roots]
    while todo:
        requirement, extras = todo.pop()
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name in found and extras <= found[name][1]:
            continue
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python, not installed here
        extras = extras | (found[name][1] if name in found else set())
        found[name] = (dist, extras)
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((child, set(child.extras)))
    return {name: dist for name, (dist, _) in sorted(found.items())}


def is_pure(dist: metadata.Distribution) -> bool:
    tags = re.findall(r"^Tag: (.+)$", dist.read_text("WHEEL") or "", re.M)
    return bool(tags) and all(tag.endswith("-none-any") for tag in tags)


def wheel_for(name: str, version: str, platforms: list[str], python_version: str) -> str | None:
    """The file name of the wheel pip finds for these platforms, or None."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", python_version, "--implementation", "cp", "-d", folder]  # fmt: skip
        for platform in platforms:
            command += ["--platform", platform]
        done = subprocess.run([*command, f"{name}=={version}"], capture_output=True, text=True)
        files = [p.name for p in Path(folder).iterdir()]
    return files[0] if done.returncode == 0 and files else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", nargs="*", default=["backend"])
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    args = parser.parse_args(argv)
    tree = installed_tree(project_requirements(args.extras))
    pure = [name for name, dist in tree.items() if is_pure(dist)]
    print(
        f"{len(tree)} distributions, {len(pure)} pure Python (any platform); the others, CPython {args.python_version}:"
    )
    print(f"| distribution | version | {' | '.join(PLATFORMS)} |")
    print(f"|---|---|{'---|' * len(PLATFORMS)}")
    missing = 0
    for name, dist in tree.items():
        if name in pure:
            continue
        cells = []
        for platforms in PLATFORMS.values():
            wheel = wheel_for(name, dist.version, platforms, args.python_version)
            missing += wheel is None
            cells.append("none" if wheel is None else re.sub(r"^.*?-cp\d+-", "", wheel).removesuffix(".whl"))
        print(f"| {name} | {dist.version} | {' | '.join(cells)} |")
    print("every one has a wheel for each platform" if not missing else f"{missing} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
