"""JSON from adapter files, parsed within stated bounds: size, nesting, values and number length.

A tenant writes the bytes (a safetensors header, the JSON strings inside its metadata,
`adapter_config.json`), and `json.loads` spends memory before anything can be checked: 8 MiB of
`[],` build about 200 MiB of lists, deep nesting raises RecursionError, a 5000-digit number
ValueError. `read` reads the text itself, left to right, with no recursion, and refuses with
`errors.InvalidJson` as soon as the text breaks one of its `Limits`: before the value that would
break it is built. So what one parse can hold is bounded by the limits, whatever the text:
the text itself, decoded once (at most 4 bytes a character), plus at most `max_values`
containers, strings and numbers. `parse` hands the text to json's C scanner instead where a
count of its characters proves that bound first and the value passes the others (the common
case: a pod's answer listing a thousand adapters, an adapter's header), and to `read` otherwise:
the same value either way, and `read`'s refusals.

It reads what `json.loads` reads and builds the same values (the last of two equal keys wins),
with three differences, all refusals, as the Rust safetensors reader refuses them too: bytes must
be UTF-8 (json.loads also guesses UTF-16 and 32, and lets encoded surrogates through), an escape
may not spell half a surrogate pair, and `NaN`, `Infinity` and `-Infinity` are not JSON. The
unit tests hold the three (json.loads, `parse`, `read`) together on generated documents.

Purely computational; imports only the standard library.
"""

from __future__ import annotations

import json.decoder
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lora_volume import errors

# json's own string scanner (its C version where there is one): unescapes, and refuses control
# characters and bad escapes, in one pass without a regular expression's backtracking stack.
_scanstring: Callable[[str, int, bool], tuple[str, int]]
_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]  # not in typeshed's stub
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# No repeated group: a group repeated over a long input grows the regex engine's own stack.
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LITERALS = {"t": ("true", True), "f": ("false", False), "n": ("null", None)}


@dataclass(frozen=True)
class Limits:
    """What one document may hold.

    `max_bytes` its length (UTF-8 bytes, or characters for a str); `max_depth` how deeply
    arrays and objects nest (the outermost is depth 1); `max_values` how many values and object
    keys it holds in all; `max_number_chars` how long one number may be written.
    """

    max_bytes: int
    max_depth: int
    max_values: int
    max_number_chars: int = 32


def parse(data: bytes | bytearray | memoryview | str, limits: Limits, *, where: str) -> Any:
    """The value of the JSON document `data` (pure); `errors.InvalidJson` naming `where` and
    the bound or syntax it breaks, before the value that breaks a bound is built. A memoryview
    of bytes is read where it lies (a header inside a file's bytes is not copied)."""
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > limits.max_bytes:
        raise errors.InvalidJson(
            f"{where} is {size} bytes long, over the limit of {limits.max_bytes}"
        )
    if isinstance(data, str):
        text = data
    else:
        try:
            text = str(data, "utf-8")
        except UnicodeDecodeError as e:
            raise errors.InvalidJson(
                f"{where} is not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
    value = _loaded_within(text, limits)
    return read(text, limits, where=where) if value is _UNPROVEN else value


def read(text: str, limits: Limits, *, where: str) -> Any:
    """The value of the JSON text, read by this module's own parser, left to right: what
    `parse` falls back to, and what states each refusal (pure)."""
    return _Parser(text, limits, where).document()


class _Unproven(Exception):
    """A number too long to pass, or a constant that is not JSON: the parser decides."""


_UNPROVEN: Any = object()
# An escape that may spell half a surrogate pair: only the parser tells a lone one from a pair.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _loaded_within(text: str, limits: Limits) -> Any:
    """json.loads's value of the text where it is provably the parser's (json's C scanner is
    some twenty times faster), else _UNPROVEN.

    Proven before json.loads builds anything: every value and key but the outermost value
    follows one of `[{,:`, so their count in the whole text (strings too) bounds the values,
    and within `max_values` nothing json.loads builds can grow past what the parser would
    hold. Checked as it reads: each number's length (its hooks), and no NaN or infinity;
    after: the depth. An escape that may spell a surrogate, or anything json.loads refuses,
    goes to the parser, whose refusals say what is wrong.
    """
    if 1 + sum(map(text.count, "[{,:")) > limits.max_values or _SURROGATE_ESCAPE.search(text):
        return _UNPROVEN
    longest = limits.max_number_chars

    def number(cast: Callable[[str], Any]) -> Callable[[str], Any]:
        def read_number(written: str) -> Any:
            if len(written) > longest:
                raise _Unproven
            return cast(written)

        return read_number

    def constant(_: str) -> Any:
        raise _Unproven

    try:
        value = json.loads(
            text, parse_int=number(int), parse_float=number(float), parse_constant=constant
        )
    except (ValueError, RecursionError, _Unproven):
        return _UNPROVEN
    return _UNPROVEN if _deeper_than(value, limits.max_depth) else value


def _deeper_than(value: Any, max_depth: int) -> bool:
    """Whether arrays and objects nest deeper than `max_depth` in the value (level by level,
    no recursion)."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        level = [
            inner
            for container in level
            for inner in (container.values() if isinstance(container, dict) else container)
            if isinstance(inner, (dict, list))
        ]
    return False


class _Parser:
    def __init__(self, text: str, limits: Limits, where: str) -> None:
        self.text, self.limits, self.where = text, limits, where
        self.values = 0

    def refuse(self, what: str) -> errors.InvalidJson:
        return errors.InvalidJson(f"{self.where} {what}")

    def syntax(self, expected: str, pos: int) -> errors.InvalidJson:
        found = repr(self.text[pos]) if pos < len(self.text) else "the end"
        return self.refuse(f"is not JSON: expected {expected} at character {pos}, found {found}")

    def count(self) -> None:
        self.values += 1
        if self.values > self.limits.max_values:
            raise self.refuse(
                f"holds more than {self.limits.max_values} values, more than any adapter needs"
            )

    def skip(self, pos: int) -> int:
        """Past the whitespace at `pos` (a compact document has none: no regex call then)."""
        if pos < len(self.text) and self.text[pos] in " \t\n\r":
            match = _WHITESPACE.match(self.text, pos)
            return match.end() if match else pos
        return pos

    def document(self) -> Any:
        """The whole text as one value. Iterative: open containers wait on `stack`, an
        object's pending key on `keys`; after each value, the loop closes what it ends."""
        text, skip, end = self.text, self.skip, len(self.text)
        stack: list[list[Any] | dict[str, Any]] = []
        keys: list[str] = []
        memo: dict[str, str] = {}  # keys repeat in every entry: one string each, as json's
        pos = skip(0)
        while True:
            # A value starts at `pos`.
            value: Any
            self.count()
            char = text[pos] if pos < end else ""
            if char == "{" or char == "[":
                if len(stack) >= self.limits.max_depth:
                    raise self.refuse(f"nests deeper than {self.limits.max_depth} levels")
                pos = skip(pos + 1)
                if text.startswith("}" if char == "{" else "]", pos):
                    value, pos = ({} if char == "{" else []), pos + 1
                else:
                    stack.append({} if char == "{" else [])
                    if char == "{":
                        pos = self.key(pos, keys, memo)
                    continue  # its first value
            elif char == '"':
                value, pos = self.string(pos)
            elif char == "-" or "0" <= char <= "9":
                value, pos = self.number(pos)
            elif char in _LITERALS and text.startswith(_LITERALS[char][0], pos):
                word, value = _LITERALS[char]
                pos += len(word)
            else:
                raise self.syntax("a value", pos)
            # The value is complete: put it in its container, and close every container that
            # ends after it.
            while True:
                pos = skip(pos)
                if not stack:
                    if pos != end:
                        raise self.syntax("the end", pos)
                    return value
                top = stack[-1]
                if isinstance(top, list):
                    top.append(value)
                    closing = "]"
                else:
                    top[keys.pop()] = value
                    closing = "}"
                if text.startswith(",", pos):
                    pos = skip(pos + 1)
                    if isinstance(top, dict):
                        pos = self.key(pos, keys, memo)
                    break  # the next value
                if not text.startswith(closing, pos):
                    raise self.syntax(f"',' or '{closing}'", pos)
                value, pos = stack.pop(), pos + 1

    def key(self, pos: int, keys: list[str], memo: dict[str, str]) -> int:
        """Read an object's key and its ':' at `pos`; where its value starts."""
        if not self.text.startswith('"', pos):
            raise self.syntax("a string key", pos)
        self.count()
        key, pos = self.string(pos)
        keys.append(memo.setdefault(key, key))
        pos = self.skip(pos)
        if not self.text.startswith(":", pos):
            raise self.syntax("':'", pos)
        return self.skip(pos + 1)

    def string(self, pos: int) -> tuple[str, int]:
        try:
            value, after = _scanstring(self.text, pos + 1, True)
        except json.JSONDecodeError as e:
            what = e.msg.removesuffix(" at")  # "Unterminated string starting at", ...
            raise self.refuse(f"is not JSON: {what} at character {e.pos}") from None
        # Escapes may spell half a surrogate pair, which no UTF-8 text (and no Rust reader of
        # the same file) holds; only a string with escapes is searched.
        if after - pos - 2 != len(value) and _SURROGATE.search(value):
            raise self.refuse(f"is not JSON: an unpaired surrogate escape at character {pos}")
        return value, after

    def number(self, pos: int) -> tuple[int | float, int]:
        match = _NUMBER.match(self.text, pos)
        if match is None:
            raise self.syntax("a number", pos)
        written = match.group()
        if len(written) > self.limits.max_number_chars:
            raise self.refuse(
                f"has a number {len(written)} characters long at character {pos}, over the "
                f"limit of {self.limits.max_number_chars}"
            )
        if match.group(1) or match.group(2):
            return float(written), match.end()
        return int(written), match.end()
