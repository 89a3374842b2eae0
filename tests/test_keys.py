"""`clairvoyant keys`: the key is shown once on standard error; standard output, meant to be appended
to the keys file (``api_keys_file``), carries only the hash entry, which the proxy's settings load."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clairvoyant.config import load_settings
from clairvoyant.proxy.access import hash_key

ROOT = Path(__file__).resolve().parents[1]
KEY = re.compile(r"^  (cv-[A-Za-z0-9_-]{40,})$", re.M)

pytestmark = pytest.mark.e2e  # the `clairvoyant keys` command, run as a process


def keys(*argv: str, stdout: Any = subprocess.PIPE, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clairvoyant", "keys", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        input=stdin,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ.get("PATH", "")},
    )


def test_keys_add_appended_to_the_keys_file_writes_no_plain_text_key(tmp_path: Path) -> None:
    """As docs/operations.md has it: the keys in a file of their own, named by the config file, to
    which settings can still be appended."""
    keys_file = tmp_path / "clairvoyant-keys.toml"
    keys_file.write_text("# the proxy's client keys")  # no newline at the end: the entry still starts on its own line
    config = tmp_path / "clairvoyant.toml"
    config.write_text('api_keys_file = "clairvoyant-keys.toml"\npolicy = "sjf"\n')
    shown = []
    for tenant, extra in (('team "a"', ["--weight", "3"]), ("ops", ["--min-priority", "2", "--max-priority", "4"])):
        with keys_file.open("a") as out:  # clairvoyant keys add ... >> clairvoyant-keys.toml
            done = keys("add", "--tenant", tenant, *extra, stdout=out)
        (key,) = KEY.findall(done.stderr)  # shown once, on standard error
        assert "shown this once" in done.stderr and "Authorization: Bearer" in done.stderr
        assert "[[api_keys]]" not in done.stderr and "sha256:" not in done.stderr
        shown.append(key)
    with config.open("a") as out:  # echo 'status_requires_key = true' >> clairvoyant.toml
        out.write("status_requires_key = true\n")
    text = keys_file.read_text()
    assert shown[0] != shown[1] and not any(key in text for key in shown)
    assert not any(key.removeprefix("cv-") in text for key in shown)
    # The files, as `clairvoyant serve --config` reads them (from another folder): both entries, by hash.
    settings = load_settings(config)
    assert settings.policy == "sjf" and settings.status_requires_key
    assert [(k.hash, k.tenant, k.weight) for k in settings.api_keys] == [
        (hash_key(shown[0]), 'team "a"', 3.0),
        (hash_key(shown[1]), "ops", 1.0),
    ]
    assert (settings.api_keys[1].min_priority, settings.api_keys[1].max_priority) == (2, 4)


def test_keys_add_standard_output_is_only_the_entry() -> None:
    done = keys("add", "--tenant", "t")
    (key,) = KEY.findall(done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines == [
        "[[api_keys]]",
        f'hash = "{hash_key(key)}"',
        'tenant = "t"',
        "min_priority = 0",
        "max_priority = 10",
        "weight = 1.0",
    ]


def test_keys_hash_matches_the_entry() -> None:
    done = keys("add", "--tenant", "t")
    (key,) = KEY.findall(done.stderr)
    hashed = keys("hash", stdin=key + "\n")
    assert hashed.stdout.strip() == hash_key(key) and f'hash = "{hashed.stdout.strip()}"' in done.stdout
