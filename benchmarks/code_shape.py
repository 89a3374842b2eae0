"""The serving code's shape: its lines, its longest functions and its largest classes.

Serving code is every module under src/clairvoyant outside tools/. A class's fields are its
annotated class-body fields plus every distinct ``self.x`` any of its methods assigns; its callbacks
are the fields whose annotation names ``Callable``. Prints the line count, the longest functions
and the classes with the most fields and with the most callbacks.

    python benchmarks/code_shape.py [--src src/clairvoyant] [--top 5]
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClassShape:
    where: str  # path:line
    name: str
    fields: int
    callbacks: int


def serving_modules(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*.py") if "tools" not in p.relative_to(src).parts)


def class_shapes(path: Path, tree: ast.Module) -> list[ClassShape]:
    shapes = []
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        annotations: dict[str, str] = {}
        for statement in cls.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                annotation = ast.unparse(statement.annotation)
                if "ClassVar" not in annotation:
                    annotations[statement.target.id] = annotation
        for method in (s for s in cls.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(method):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                    targets = [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        if target.value.id == "self":
                            annotation = ast.unparse(node.annotation) if isinstance(node, ast.AnnAssign) else ""
                            annotations.setdefault(target.attr, annotation)
        callbacks = sum("Callable" in annotation for annotation in annotations.values())
        shapes.append(ClassShape(f"{path}:{cls.lineno}", cls.name, len(annotations), callbacks))
    return shapes


def function_lengths(path: Path, tree: ast.Module) -> list[tuple[int, str]]:
    return [
        (node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path("src/clairvoyant"))
    parser.add_argument("--top", type=int, default=5, help="rows of each table (default 5)")
    args = parser.parse_args()
    lines = 0
    shapes: list[ClassShape] = []
    functions: list[tuple[int, str]] = []
    for path in serving_modules(args.src):
        text = path.read_text()
        lines += len(text.splitlines())
        tree = ast.parse(text)
        shapes += class_shapes(path, tree)
        functions += function_lengths(path, tree)
    print(f"serving lines: {lines:,}")
    print("\nlongest functions (lines):")
    for length, where in sorted(functions, reverse=True)[: args.top]:
        print(f"  {length:4d}  {where}")
    print("\nmost fields (fields, callbacks):")
    for shape in sorted(shapes, key=lambda s: (-s.fields, -s.callbacks))[: args.top]:
        print(f"  {shape.fields:4d} {shape.callbacks:2d}  {shape.where} {shape.name}")
    print("\nmost callbacks (callbacks, fields):")
    for shape in sorted(shapes, key=lambda s: (-s.callbacks, -s.fields))[: args.top]:
        print(f"  {shape.callbacks:4d} {shape.fields:2d}  {shape.where} {shape.name}")


if __name__ == "__main__":
    main()
