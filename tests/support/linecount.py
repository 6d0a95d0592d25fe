"""The lines of the checkout's own Python code a piece of work runs: the scale tests' measure of
work, the same on any machine and under any load (what runs in C, the standard library and the
installed packages is not counted)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from tests.support import ROOT

VENV = ROOT / ".venv"


@contextmanager
def project_lines(
    on_line: Callable[[], None], *, threads: bool = False, skip: Path | None = None
) -> Iterator[None]:
    """Call `on_line` for every line of the checkout's code run inside the block (not `skip`,
    a test module counting itself); with `threads`, in the threads started inside it too."""
    ours: dict[str, bool] = {}

    def local(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            on_line()
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        name = frame.f_code.co_filename
        mine = ours.get(name)
        if mine is None:
            path = Path(name)
            mine = ours[name] = (
                path.is_relative_to(ROOT) and not path.is_relative_to(VENV) and path != skip
            )
        return local if mine else None

    before = sys.gettrace()
    if threads:
        threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(before)
        if threads:
            threading.settrace(None)
