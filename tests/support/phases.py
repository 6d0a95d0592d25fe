"""Naming the phase of a long scenario that failed.

A cluster scenario runs for minutes through many phases (apply, scale, kill, update, delete), and
most of its failures are a timeout whose message names only what it waited for. A test that
takes the `phase` fixture announces each phase as it starts, `phase("scale 2 -> 3")`; whatever
exception then fails the test says which phase it came from, in the one-line summary pytest
prints as well as in the traceback. A phase lasts until the next one starts.

A pytest plugin (tests/conftest.py loads it): the fixture, and the hook around the test's call
that names the phase. pytest's own outcomes (skip, xfail, `pytest.fail`) pass untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import pytest

Phase = Callable[[str], None]

_CURRENT = pytest.StashKey[str]()


def name_the_phase(error: BaseException, name: str) -> None:
    """Prefix the message of `error` with `in phase '<name>': ` (the same object and type, so
    the traceback and the assertion's explanation stay); when its message is not its first
    argument, add that line as a note instead."""
    prefix = f"in phase {name!r}"
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{prefix}: {error.args[0]}", *error.args[1:])
    if prefix not in str(error):
        error.add_note(prefix)


@pytest.fixture
def phase(request: pytest.FixtureRequest) -> Phase:
    """Call it with the name of the phase the test starts."""

    def start(name: str) -> None:
        request.node.stash[_CURRENT] = name

    return start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    except Exception as e:
        name = item.stash.get(_CURRENT, None)
        if name is not None:
            name_the_phase(e, name)
        raise
