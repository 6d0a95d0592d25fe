"""The docs' fenced code blocks with their `<!-- docs-test: ... -->` markers, and a shell block's
commands as argument lists (pure): the docs test runs them, and end-to-end tests run a task's
blocks as written."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(r"^\s*<!-- docs-test: (run|dry-run|skip)(?: \((.+)\))? -->\s*$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    mode: str | None
    reason: str | None
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def parse_blocks(doc: Path, text: str) -> list[Block]:
    """The fenced blocks of a Markdown file with their markers (pure)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, indent = i, len(fence.group(1))
        i += 1
        body = []
        while i < len(lines) and not _FENCE.match(lines[i]):
            body.append(lines[i][indent:])
            i += 1
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(above)
        blocks.append(
            Block(
                doc,
                start + 1,
                fence.group(2),
                marker.group(1) if marker else None,
                marker.group(2) if marker else None,
                "\n".join(body) + "\n",
            )
        )
        i += 1
    return blocks


def commands(text: str) -> Iterator[list[str]]:
    """Shell lines as argument lists: continuations joined, comments dropped, a trailing `&`
    and anything after a pipe left out (pure)."""
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if "|" in words:
            words = words[: words.index("|")]
        if words and words[-1] == "&":
            words = words[:-1]
        if words:
            yield words
