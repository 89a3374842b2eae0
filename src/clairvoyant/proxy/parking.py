"""TEMPORARY stub until the parking branch lands."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class ParkingLot:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_left: Callable[[object], None]) -> None:
        self.loop = loop

    @property
    def enabled(self) -> bool:
        return False

    def park(self, transport: Any, owner: object) -> int | None:
        return None

    async def resume(self, fd: int, protocol_factory: Any) -> Any:
        raise OSError

    def refuse(self, fd: int, data: bytes) -> None: ...

    def close(self) -> None: ...

    def __len__(self) -> int:
        return 0
