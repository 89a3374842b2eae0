"""benchmarks/code_shape.py counts what it says: class fields, callbacks and function lengths."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import code_shape  # noqa: E402

SNIPPET = """
class Record:
    kind: ClassVar[str] = "x"
    name: str
    on_done: Callable[[], None]

    def __init__(self) -> None:
        self.count = 0
        self.name = "again"
        self.hook: Callable[[int], None] | None = None

    def bump(self) -> None:
        self.count += 1
        self.total_s = 2.0


def outside() -> None:
    pass
"""


def test_fields_are_class_body_annotations_and_every_self_attribute_once() -> None:
    [shape] = code_shape.class_shapes(Path("m.py"), ast.parse(SNIPPET))
    assert shape.name == "Record"
    assert shape.fields == 5  # name, on_done, count, hook, total_s; the ClassVar is not a field
    assert shape.callbacks == 2  # on_done, hook


def test_function_lengths_count_every_line_of_each_function() -> None:
    lengths = dict((where.split()[-1], n) for n, where in code_shape.function_lengths(Path("m.py"), ast.parse(SNIPPET)))
    assert lengths == {"__init__": 4, "bump": 3, "outside": 2}


def test_serving_modules_leave_out_tools(tmp_path: Path) -> None:
    for name in ("a.py", "tools/b.py", "proxy/c.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    assert [p.relative_to(tmp_path).as_posix() for p in code_shape.serving_modules(tmp_path)] == ["a.py", "proxy/c.py"]
