"""The store's locks: a namespace publishes one revision at a time, namespaces side by side,
and a collection alone, before the publishes that begin after it asked."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager

from lora_operator.store.publishlocks import PublishLocks


async def _hold(
    held: AbstractAsyncContextManager[None],
    inside: list[str],
    log: list[str],
    name: str,
    go: asyncio.Event,
) -> None:
    async with held:
        inside.append(name)
        log.append(f"+{name}")
        await go.wait()
        inside.remove(name)
        log.append(f"-{name}")


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_namespaces_publish_side_by_side_and_one_namespace_one_at_a_time() -> None:
    locks, inside, log = PublishLocks(), list[str](), list[str]()
    go = {n: asyncio.Event() for n in ("a1", "a2", "b1")}
    tasks = [
        asyncio.create_task(_hold(locks.namespace(ns), inside, log, n, go[n]))
        for ns, n in (("a", "a1"), ("a", "a2"), ("b", "b1"))
    ]
    await _settle()
    assert sorted(inside) == ["a1", "b1"]  # b beside a; a's second waits for its first
    go["a1"].set()
    await _settle()
    assert sorted(inside) == ["a2", "b1"]
    go["a2"].set()
    go["b1"].set()
    await asyncio.gather(*tasks)
    assert inside == []


async def _publish_collect_publish(
    inside: list[str], log: list[str], go: dict[str, asyncio.Event]
) -> tuple[asyncio.Task[None], ...]:
    """A publish under way in `a`, then a collection asking, then a publish in `b` asking."""
    locks = PublishLocks()
    early = asyncio.create_task(_hold(locks.namespace("a"), inside, log, "early", go["early"]))
    await _settle()
    gc = asyncio.create_task(_hold(locks.everything(), inside, log, "gc", go["gc"]))
    await _settle()
    late = asyncio.create_task(_hold(locks.namespace("b"), inside, log, "late", go["late"]))
    await _settle()
    return early, gc, late


async def test_a_collection_waits_for_the_publishes_under_way_and_goes_before_later_ones() -> None:
    inside, log = list[str](), list[str]()
    go = {n: asyncio.Event() for n in ("early", "gc", "late")}
    early, gc, late = await _publish_collect_publish(inside, log, go)
    assert inside == ["early"]  # the collection waits; the later publish waits behind it
    go["early"].set()
    await _settle()
    assert inside == ["gc"]
    go["gc"].set()
    await _settle()
    assert inside == ["late"]
    go["late"].set()
    await asyncio.gather(early, gc, late)
    assert log == ["+early", "-early", "+gc", "-gc", "+late", "-late"]


async def test_a_collection_cancelled_while_it_waits_holds_no_publish_back() -> None:
    inside, log = list[str](), list[str]()
    go = {n: asyncio.Event() for n in ("early", "gc", "late")}
    early, gc, late = await _publish_collect_publish(inside, log, go)
    gc.cancel()
    await _settle()
    assert sorted(inside) == ["early", "late"]
    go["early"].set()
    go["late"].set()
    await asyncio.gather(early, late)
    assert gc.cancelled()
