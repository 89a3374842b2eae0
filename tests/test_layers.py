"""The package's layers: each imports only from below it, so the tree reads as the request's flow.

    config, errors, clock, state_file, logs (the bottom: settings, errors, time, atomic state files, log format)
    prediction/                      dialects, features, predictor, learner, usage
    scheduling/, metrics             job record and queues, policies, dispatcher and its lease
    proxy/                           server (Granian), app, scheduled, relay, upstream and its aiohttp transport, pool, limits, ui/, the closed loop's wiring, serve
    tools/                           training, simulator, benchmarks, demo, replay (never served)
    cli                              the command line

One exception, by design: ``config`` reads the policy registry's names (``scheduling.policy``, a
pure module) to validate the ``policy`` setting, so names live in one place.

Within and across layers, no module imports itself back through others (no circle), counting
imports made inside functions too: a lazy import hides a circle from Python, not from a reader.
Imports under ``if TYPE_CHECKING:`` count as well: a type name shared both ways belongs lower down.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "src" / "clairvoyant"
LAYER = {
    "errors": 0,
    "clock": 0,
    "config": 0,
    "state_file": 0,
    "logs": 0,
    "prediction": 1,
    "scheduling": 2,
    "metrics": 2,
    "proxy": 3,
    "tools": 4,
    "cli": 5,
    "__main__": 5,
    "__init__": 0,
}
ALLOWED = {("config", "clairvoyant.scheduling.policy")}


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clairvoyant."):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("clairvoyant.")]
    return found


MODULES = sorted(p for p in ROOT.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = ("clairvoyant", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the package's modules (``from clairvoyant.x import y`` counts as an
    import of ``clairvoyant.x.y`` when that is a module, else of ``clairvoyant.x``)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clairvoyant"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports (its modules, the first repeated at the end), or [] when there is none."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return []


def test_no_module_imports_itself_back_through_others() -> None:
    circle = _circle(_graph({_module_name(p): p for p in MODULES}))
    assert not circle, "import circle: " + " -> ".join(circle)


def test_the_circle_check_sees_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from clairvoyant.b import B\n")
    (tmp_path / "b.py").write_text("def make():\n    from clairvoyant.a import A\n")
    (tmp_path / "c.py").write_text("import clairvoyant.a\n")
    modules = {f"clairvoyant.{n}": tmp_path / f"{n}.py" for n in "abc"}
    assert sorted(set(_circle(_graph(modules)))) == ["clairvoyant.a", "clairvoyant.b"]
    (tmp_path / "b.py").write_text("")
    assert _circle(_graph(modules)) == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_from_its_layer_or_below(path: Path) -> None:
    layer = path.relative_to(ROOT).parts[0].removesuffix(".py")
    assert layer in LAYER, f"{layer} is not a known layer: add it to LAYER and the docstring"
    upward = [m for m in _imports(path) if LAYER.get(m.split(".")[1], 99) > LAYER[layer] and (layer, m) not in ALLOWED]
    assert not upward, f"{path.relative_to(ROOT)} imports upward: {upward}"


def test_the_layers_are_the_tree() -> None:
    top = {p.name.removesuffix(".py") for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert top == set(LAYER) - {"model"}
