"""The model switch bound in the shared queue (grant.lua's ``held_instead``), on a real Redis: a
backend keeps the model it holds for a request of that model while the policy's pick, of another
model, has been put off less than the bound."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

from clairvoyant.scheduling.cluster.shared import BackendSpec, Entry, Message, MessageKind
from clairvoyant.scheduling.cluster.store import RedisSlotStore

_names = itertools.count()


async def next_grant(messages: AsyncIterator[Message]) -> str:
    async for message in messages:
        if message.kind is MessageKind.GRANT:
            return message.request_id
    raise AssertionError("the messages ended")


async def quiet_over(store: RedisSlotStore) -> None:
    """Beat (a replica silent for a lease is dropped) until the pause is over."""
    while (await store.view()).quiet_s > 0:
        await store.renew([])
        await asyncio.sleep(0.05)
    await store.renew([])


async def order_after_holder(url: str, bound_s: float) -> list[str]:
    """One backend with one slot holds model a (its first request); then a short request for b and
    a long one for a wait. The order they are granted in."""
    store = RedisSlotStore(url, f"switch{next(_names)}", "r0", lease_s=2.0, switch_bound_s=bound_s)
    try:
        await store.join([BackendSpec("b0", 1)])
        await asyncio.wait_for(quiet_over(store), 10)  # a new cluster's pause: one lease
        messages = store.messages()
        await store.enqueue(Entry("hold", model="a", score=0.5))
        assert await asyncio.wait_for(next_grant(messages), 10) == "hold"
        await store.enqueue(Entry("b-short", model="b", score=0.1))
        await store.enqueue(Entry("a-long", model="a", score=0.9))
        await store.release("hold", 1.0)
        first = await asyncio.wait_for(next_grant(messages), 10)
        await store.release(first, 1.0)
        second = await asyncio.wait_for(next_grant(messages), 10)
        return [first, second]
    finally:
        await store.leave()
        await store.aclose()


def test_a_backend_keeps_its_model_within_the_bound(redis_server: Any) -> None:
    assert asyncio.run(order_after_holder(redis_server.url, 30.0)) == ["a-long", "b-short"]


def test_without_the_bound_the_shortest_goes_first_and_switches(redis_server: Any) -> None:
    assert asyncio.run(order_after_holder(redis_server.url, 0.0)) == ["b-short", "a-long"]
