"""The package's layers: each imports only from below it, so the tree reads as the request's flow.

    config, errors, clock, state_file, logs (the bottom: settings, errors, time, atomic state files, log format)
    prediction/                      dialects, features, predictor, learner, usage
    scheduling/, metrics             job record and queues, policies, dispatcher and its lease
    proxy/                           connection (the HTTP server), parking, keepalive, app, responses, upstream, server, ui/, the closed loop's wiring, serve
    tools/                           training, simulator, benchmarks, demo, replay (never served)
    cli                              the command line

One exception, by design: ``config`` reads the policy registry's names (``scheduling.policy``, a
pure module) to validate the ``policy`` setting, so names live in one place.
"""

from __future__ import annotations

import ast
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


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_from_its_layer_or_below(path: Path) -> None:
    layer = path.relative_to(ROOT).parts[0].removesuffix(".py")
    assert layer in LAYER, f"{layer} is not a known layer: add it to LAYER and the docstring"
    upward = [m for m in _imports(path) if LAYER.get(m.split(".")[1], 99) > LAYER[layer] and (layer, m) not in ALLOWED]
    assert not upward, f"{path.relative_to(ROOT)} imports upward: {upward}"


def test_the_layers_are_the_tree() -> None:
    top = {p.name.removesuffix(".py") for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert top == set(LAYER) - {"model"}
