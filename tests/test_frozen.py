"""fast_init: the same record as the dataclass's own __init__, built through the slot setters."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import KW_ONLY, dataclass

import pytest

from clairvoyant.prediction.dialects import ParsedRequest
from clairvoyant.prediction.features import Prompt
from clairvoyant.prediction.frozen import fast_init
from clairvoyant.prediction.usage import Usage
from clairvoyant.proxy.responses import UpstreamRequest


@dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: str = "x"
    _: KW_ONLY
    c: float = 1.5
    d: tuple[int, ...] = ()


Fast = fast_init(dataclass(frozen=True, slots=True)(type("Fast", (), {"__annotations__": dict(Plain.__annotations__),
                                                                      "b": "x", "c": 1.5, "d": ()})))  # fmt: skip


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1,), {}), ((1, "y"), {}), ((1,), {"c": 2.0}), ((), {"a": 3, "b": "z", "c": 0.5, "d": (1, 2)})],
)
def test_fields_defaults_and_keyword_only_as_the_dataclass(args: tuple, kwargs: dict) -> None:
    plain, fast = Plain(*args, **kwargs), Fast(*args, **kwargs)
    assert dataclasses.astuple(fast) == dataclasses.astuple(plain)
    assert repr(fast).replace("Fast", "Plain") == repr(plain)
    assert fast == Fast(*args, **kwargs) and hash(fast) == hash(Fast(*args, **kwargs))
    assert dataclasses.replace(fast, a=9).a == 9


def test_wrong_calls_fail_as_the_dataclass() -> None:
    for make in (Plain, Fast):
        with pytest.raises(TypeError):
            make()  # a missing positional field
        with pytest.raises(TypeError):
            make(1, "y", 2.0)  # c is keyword-only
        with pytest.raises(dataclasses.FrozenInstanceError):
            make(1).a = 2  # type: ignore[misc]
    assert list(inspect.signature(Fast).parameters) == list(inspect.signature(Plain).parameters)


def test_refuses_what_it_does_not_support() -> None:
    @dataclass(slots=True)
    class Mutable:
        a: int

    @dataclass(frozen=True, slots=True)
    class WithFactory:
        a: list[int] = dataclasses.field(default_factory=list)

    for cls in (Mutable, WithFactory):
        with pytest.raises(TypeError):
            fast_init(cls)


def test_the_request_records_use_it() -> None:
    for cls in (Prompt, ParsedRequest, Usage, UpstreamRequest):
        assert cls.__init__.__module__ == cls.__module__ and "_set0" in cls.__init__.__code__.co_names
    usage = Usage(3, None, None, None, 0.5, "m", "openai_usage", 0)
    assert (usage.output_tokens, usage.wall_s, usage.source, usage.observed) == (3, 0.5, "openai_usage", True)
    assert Prompt("hi").context_chars == -1 and Prompt("hi", 5, turns=2).turns == 2
