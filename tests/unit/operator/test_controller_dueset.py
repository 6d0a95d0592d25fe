"""The due set the status writer and rollouts each wait on: marks, times, one wake-up."""

from __future__ import annotations

import asyncio
import time

from lora_operator.controller.dueset import DueSet

A, B, C = ("ns", "a"), ("ns", "b"), ("ns", "c")


def test_take_returns_the_marked_and_the_due_and_clears_only_the_marks() -> None:
    due = DueSet()
    now = time.monotonic()
    due.mark(A)
    due.at(B, now - 1)
    due.at(C, now + 3600)
    assert due.take(now) == {A, B}
    # Marks are taken once; a time stays until the pass unschedules it.
    assert due.take(now) == {B}
    assert due.unschedule(B) == now - 1
    assert due.unschedule(B) is None
    assert due.take(now) == set()
    assert due.take(now + 3601) == {C}


def test_forget_drops_a_mark_and_a_time() -> None:
    due = DueSet()
    due.mark(A)
    due.after(A, 0)
    due.forget(A)
    assert due.take(time.monotonic() + 1) == set()


def test_wait_returns_for_a_mark_and_for_a_time_that_comes() -> None:
    async def scenario() -> None:
        due = DueSet()
        waiting = asyncio.create_task(due.wait())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing marked, no time: it waits
        due.mark(A)
        await asyncio.wait_for(waiting, 5)
        due.take(time.monotonic())
        # A time set from inside a pass wakes nobody, but the next wait ends when it comes.
        due.at(B, time.monotonic() + 0.05)
        await asyncio.wait_for(due.wait(), 5)
        assert due.take(time.monotonic()) == {B}
        # A time set from outside (a retry) wakes a wait already under way.
        waiting = asyncio.create_task(due.wait())
        await asyncio.sleep(0.01)
        due.after(C, 0.0)
        await asyncio.wait_for(waiting, 5)
        assert C in due.take(time.monotonic())

    asyncio.run(scenario())
