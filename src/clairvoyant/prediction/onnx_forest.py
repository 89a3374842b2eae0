"""A tree-ensemble regressor read out of its ONNX file, for the compiled walk (``_forest.c``).

The shipped predictor is one ``ai.onnx.ml.TreeEnsembleRegressor`` node (XGBoost, exported by
onnxmltools). Calling ONNX Runtime costs 3-5 us before the model does anything; the 150 trees
themselves take well under 1 us to walk. ``forest_tables`` reads the node's attributes straight
from the file's protobuf wire format (serving does not depend on the ``onnx`` package, and
onnxruntime exposes no graph) and lays the trees out as ``_forest.Forest`` takes them. It returns
the reason instead (a str) for any model it does not reproduce exactly: another operator or more than
one node, several targets, a post transform, an aggregate other than SUM, a branch mode other than
BRANCH_LT, missing values that track true, several weights on one leaf. The predictor then keeps
ONNX Runtime, and it also checks the walk against ONNX Runtime on start-up before using it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clairvoyant.prediction.onnx_wire import fields, signed, varint

try:  # the compiled walk (prediction/_forest.c), built by `pip install`; else ONNX Runtime runs the model
    from clairvoyant.prediction import _forest
except ImportError:  # pragma: no cover - installed where no C compiler was found
    _forest = None  # type: ignore[assignment]

__all__ = ["ForestTables", "compiled_forest", "forest_tables"]

_NODE = struct.Struct("=ifii")  # feature (-1: a leaf), threshold or leaf weight, true next, false next
_LEAF = -1

# Field numbers of onnx.proto (onnx/onnx.proto3) that lead to a node's attributes.
_MODEL_GRAPH = 7
_GRAPH_NODE = 1
_NODE_OP_TYPE, _NODE_DOMAIN, _NODE_ATTRIBUTE = 4, 7, 5
_ATTR_NAME, _ATTR_F, _ATTR_I, _ATTR_S, _ATTR_FLOATS, _ATTR_INTS, _ATTR_STRINGS = 1, 2, 3, 4, 7, 8, 9


@dataclass(frozen=True, slots=True)
class ForestTables:
    """The arguments of ``_forest.Forest`` (less the buffers): nodes as packed ``_NODE`` records in
    depth-first order (so every next node comes after its parent), each tree's root index as int32,
    in the model's tree order, and the base value."""

    nodes: bytes
    roots: bytes
    base: float

    @property
    def n_trees(self) -> int:
        return len(self.roots) // 4


def _attribute(data: bytes) -> tuple[str, object]:
    """One AttributeProto as (name, value): a float, int, bytes, or a list of one of them."""
    name = ""
    scalar: object = None
    floats: list[float] = []
    ints: list[int] = []
    strings: list[bytes] = []
    for number, wire, value in fields(data):
        if number == _ATTR_NAME and isinstance(value, bytes):
            name = value.decode()
        elif number == _ATTR_F and isinstance(value, bytes):
            scalar = struct.unpack("<f", value)[0]
        elif number == _ATTR_I and isinstance(value, int):
            scalar = signed(value)
        elif number == _ATTR_S and isinstance(value, bytes):
            scalar = value
        elif number == _ATTR_FLOATS and isinstance(value, bytes):
            if wire == 2:  # packed
                floats.extend(struct.unpack(f"<{len(value) // 4}f", value))
            else:
                floats.append(struct.unpack("<f", value)[0])
        elif number == _ATTR_INTS:
            if isinstance(value, int):
                ints.append(signed(value))
            else:
                at = 0
                while at < len(value):
                    item, at = varint(value, at)
                    ints.append(signed(item))
        elif number == _ATTR_STRINGS and isinstance(value, bytes):
            strings.append(value)
    return name, floats or ints or strings or scalar


def _nodes(model: bytes) -> list[tuple[str, str, dict[str, object]]]:
    """(domain, op_type, attributes) of every node of the model's graph."""
    graphs = [v for n, w, v in fields(model) if n == _MODEL_GRAPH and isinstance(v, bytes)]
    if len(graphs) != 1:
        raise ValueError("no graph")
    out = []
    for number, _, node in fields(graphs[0]):
        if number != _GRAPH_NODE or not isinstance(node, bytes):
            continue
        op_type = domain = ""
        attributes: dict[str, object] = {}
        for field, _, value in fields(node):
            if field == _NODE_OP_TYPE and isinstance(value, bytes):
                op_type = value.decode()
            elif field == _NODE_DOMAIN and isinstance(value, bytes):
                domain = value.decode()
            elif field == _NODE_ATTRIBUTE and isinstance(value, bytes):
                name, attribute = _attribute(value)
                attributes[name] = attribute
        out.append((domain, op_type, attributes))
    return out


def forest_tables(path: Path) -> ForestTables | str:
    """The model's trees as ``_forest.Forest`` takes them, or the reason they cannot be (a str)."""
    try:
        nodes = _nodes(path.read_bytes())
    except (OSError, ValueError, IndexError, struct.error, UnicodeDecodeError) as exc:
        return f"unreadable ONNX file: {exc}"
    if len(nodes) != 1 or nodes[0][:2] != ("ai.onnx.ml", "TreeEnsembleRegressor"):
        return f"not a single TreeEnsembleRegressor: {[op for _, op, _ in nodes]}"
    a = nodes[0][2]

    def ints(name: str) -> list[int]:
        value = a.get(name, [])
        return value if isinstance(value, list) and all(isinstance(v, int) for v in value) else []

    def floats(name: str) -> list[float]:
        value = a.get(name, [])
        return [float(v) for v in value] if isinstance(value, list) else []

    if a.get("n_targets", 1) != 1:
        return "more than one target"
    if a.get("post_transform", b"NONE") != b"NONE":
        return f"post_transform {a.get('post_transform')!r}"
    if a.get("aggregate_function", b"SUM") != b"SUM":
        return f"aggregate_function {a.get('aggregate_function')!r}"
    tree_ids, node_ids = ints("nodes_treeids"), ints("nodes_nodeids")
    features, thresholds = ints("nodes_featureids"), floats("nodes_values")
    true_ids, false_ids = ints("nodes_truenodeids"), ints("nodes_falsenodeids")
    modes = a.get("nodes_modes", [])
    missing = ints("nodes_missing_value_tracks_true")
    n = len(tree_ids)
    if (
        not n
        or not isinstance(modes, list)
        or any(len(x) != n for x in (node_ids, features, true_ids, false_ids, modes))
    ):
        return "node attributes missing or of unequal lengths"
    if len(thresholds) != n:
        return "nodes_values missing (thresholds given as a tensor, or of another length)"
    if any(missing):
        return "missing values that track true"
    if set(modes) - {b"BRANCH_LT", b"LEAF"}:
        return f"branch modes {sorted(set(modes) - {b'LEAF'})}"
    base_values = floats("base_values") or [0.0]
    target_trees, target_nodes = ints("target_treeids"), ints("target_nodeids")
    weights = floats("target_weights")
    if len(base_values) != 1 or any(t != 0 for t in ints("target_ids")):
        return "more than one target"
    if not (len(target_trees) == len(target_nodes) == len(weights)):
        return "target attributes of unequal lengths"
    leaf_weight = dict(zip(zip(target_trees, target_nodes, strict=True), weights, strict=True))
    if len(leaf_weight) != len(weights):
        return "a leaf with several weights"
    index = {(t, i): k for k, (t, i) in enumerate(zip(tree_ids, node_ids, strict=True))}
    if len(index) != n:
        return "duplicate node ids"

    records: list[bytes] = []
    roots: list[int] = []
    tree_order = list(dict.fromkeys(tree_ids))  # the trees in the order the model lists them
    children: set[tuple[int, int]] = set()  # (tree, node id) of every node a branch leads to
    for t, mode, true_id, false_id in zip(tree_ids, modes, true_ids, false_ids, strict=True):
        if mode != b"LEAF":
            children.update(((t, true_id), (t, false_id)))
    roots_of: dict[int, list[int]] = {t: [] for t in tree_order}
    for t, i in index:
        if (t, i) not in children:
            roots_of[t].append(i)
    if any(len(r) != 1 for r in roots_of.values()):
        return "a tree without exactly one root"
    try:
        for tree in tree_order:
            roots.append(len(records))
            records += _depth_first(
                tree, roots_of[tree][0], index, modes, features, thresholds, true_ids, false_ids, leaf_weight,
                base=len(records),
            )  # fmt: skip
    except (KeyError, RecursionError) as exc:
        return f"a tree that does not close: {exc!r}"
    return ForestTables(b"".join(records), struct.pack(f"={len(roots)}i", *roots), base_values[0])


def _depth_first(
    tree: int,
    root: int,
    index: dict[tuple[int, int], int],
    modes: list[object],
    features: list[int],
    thresholds: list[float],
    true_ids: list[int],
    false_ids: list[int],
    leaf_weight: dict[tuple[int, int], float],
    *,
    base: int,
) -> list[bytes]:
    """One tree's records in depth-first order, next indices offset by ``base`` (where the tree
    starts in the whole array). A node visited twice (not a tree) raises KeyError."""
    records: list[bytes] = []
    seen: set[int] = set()

    def visit(node_id: int) -> int:
        k = index[(tree, node_id)]
        if k in seen:
            raise KeyError(f"node {node_id} of tree {tree} reached twice")
        seen.add(k)
        at = len(records)
        records.append(b"")
        if modes[k] == b"LEAF":
            records[at] = _NODE.pack(_LEAF, leaf_weight.get((tree, node_id), 0.0), 0, 0)
        else:
            true_at = visit(true_ids[k])
            false_at = visit(false_ids[k])
            records[at] = _NODE.pack(features[k], thresholds[k], base + true_at, base + false_at)
        return at

    visit(root)
    return records


def compiled_forest(
    path: Path, row: Any, out: Any, reference_run: Callable[[], object], *, seed: int = 0, checks: int = 512
) -> tuple[Callable[[], None] | None, str]:
    """A call that fills ``out[0]`` from ``row`` as ``reference_run`` (ONNX Runtime, bound to the same
    two float32 buffers) does, walking the trees in C; or (None, why not). The walk is used only if
    it gives the very same float32 as ``reference_run`` on ``checks`` rows: the row as it is, zeros,
    and seeded rows whose features sit on a threshold the trees compare with or just below it (where
    ``<`` and ``<=`` part). ``row`` is left as it was found."""
    if _forest is None:
        return None, "not compiled (no C compiler at install)"
    tables = forest_tables(path)
    if isinstance(tables, str):
        return None, tables
    try:  # the constructor refuses a feature past the row, and any other index out of range
        forest = _forest.Forest(tables.nodes, tables.roots, tables.base, row, out)
    except (TypeError, ValueError) as exc:
        return None, str(exc)
    saved = row.copy()
    try:
        thresholds = _thresholds(tables)
        rng = np.random.default_rng(seed)
        for k in range(checks):
            if k == 1:
                row[:] = 0.0
            elif k > 1:
                for feature, values in thresholds.items():
                    if rng.random() < 0.5:
                        value = values[rng.integers(len(values))]
                        row[feature] = value if rng.random() < 0.5 else np.nextafter(value, np.float32(-np.inf))
            reference_run()
            expected = float(out[0])
            forest.run()
            if float(out[0]) != expected and not (math.isnan(expected) and math.isnan(float(out[0]))):
                return None, f"differs from ONNX Runtime on check row {k}: {float(out[0])!r} vs {expected!r}"
    finally:
        row[:] = saved
    return forest.run, "compiled"


def _thresholds(tables: ForestTables) -> dict[int, np.ndarray]:
    """Each feature a branch reads: the float32 thresholds it is compared with."""
    by_feature: dict[int, list[float]] = {}
    for feature, value, _, _ in _NODE.iter_unpack(tables.nodes):
        if feature != _LEAF:
            by_feature.setdefault(feature, []).append(value)
    return {f: np.array(v, dtype=np.float32) for f, v in by_feature.items()}
