"""The docs' fenced code blocks with their `<!-- docs-test: ... -->` markers, a shell block's
commands as argument lists, and the values a `helm install`/`upgrade` line renders with (pure):
the docs test runs them, the chart's tests render them, and end-to-end tests run a task's
blocks as written (`run_script`, the one part that runs anything)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT

# The registry values every install in the docs passes first: what a release installed by the
# docs holds, so `--reuse-values` and a backup's `helm get values` hold it too.
MY_REGISTRY_VALUES = "examples/values-my-registry.yaml"
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


def written_by(doc: Path) -> set[str]:
    """The files the doc's own commands write (`> helm-values.yaml`), which a later block may
    read: the checkout has none of them."""
    return {
        words[words.index(">") + 1]
        for block in parse_blocks(doc, doc.read_text())
        if block.lang == "sh"
        for words in commands(block.text)
        if ">" in words[:-1]
    }


def helm_values_args(words: list[str], written: set[str]) -> list[str]:
    """The values flags of a `helm install`/`upgrade`/`template` line, as a render without the
    release has them (pure): `-f`/`--values` and `--set*` as written, paths relative to the
    checkout; a file in `written` (a backup's `helm get values`) and `--reuse-values` stand for
    the release's own values, which a render without the release has not: the docs install
    with MY_REGISTRY_VALUES, so they become that file."""
    out, i = [], 0
    if "--reuse-values" in words:
        out += ["-f", MY_REGISTRY_VALUES]
    while i < len(words):
        if words[i] in ("-f", "--values") and i + 1 < len(words) and words[i + 1] in written:
            out += ["-f", MY_REGISTRY_VALUES]
            i += 2
        elif words[i] in ("-f", "--values", "--set", "--set-string", "--set-json"):
            out += words[i : i + 2]
            i += 2
        else:
            i += 1
    return out


def run_script(script: str, cwd: Path, log: Path, timeout: float, env: Mapping[str, str]) -> None:
    """Run `script` with bash -euo pipefail in its own process group, as a user pastes a block;
    afterwards stop what it left in the background (a port-forward). Fails with the script's
    output when it does."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    assert code == 0, f"the block failed (exit {code}):\n{script}\n---\n{log.read_text()[-6000:]}"
