# The compiled tree walk (_forest.c): its docstring says what Forest computes.

from typing import Any

class Forest:
    def __init__(self, nodes: bytes, roots: bytes, base: float, row: Any, out: Any) -> None: ...
    def run(self) -> None: ...
