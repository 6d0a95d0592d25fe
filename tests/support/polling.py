"""The one way the tests wait for something to happen: poll until a check holds, and fail (never
hang) after a timeout, naming what was waited for.

The check may be a plain or an async function; what it returned, once truthy, is the result.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


# Two signatures, so that an async check's result type is what it awaits to: with one
# `Callable[[], T | Awaitable[T]]`, mypy solves a coroutine returning bool as `Awaitable[Never]`.
# A check returning `X | None` waits for the X: only a truthy value comes back.
@overload
async def until(
    what: str,
    check: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


@overload
async def until(
    what: str,
    check: Callable[[], T | None],
    *,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


async def until(
    what: str,
    check: Callable[[], Any],
    *,
    timeout: float = 20.0,
    interval: float = 0.01,
) -> Any:
    """Poll `check` every `interval` seconds until it returns something truthy; that value.
    AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
