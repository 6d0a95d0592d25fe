"""A tar archive read as it streams in, within bounds: the files of an image layer, one pass.

`TarStream.feed` takes the archive's bytes as they arrive (already decompressed) and tells
`on_file(name, size)` of each regular file; the callback returns where that file's bytes go
(or None to skip them). What is kept in memory is one 512-byte header or one metadata entry
(a PAX header, a GNU long name) of at most `max_meta_bytes`: a file's bytes pass through.
Bounded: `max_members` entries, and `max_meta_bytes` for each metadata entry, past which the
archive is refused (`TarRefused`) before its bytes are kept. Formats: ustar, GNU (long names,
base-256 sizes) and PAX (`path`, `size`), which is what Python's tarfile, GNU tar, Go's
archive/tar (docker, buildah) write; held to Python's tarfile in tests/unit/operator/test_oci.py.

Pure: no I/O (the caller feeds the bytes); links, devices and directories are skipped.
"""

from __future__ import annotations

from collections.abc import Callable

BLOCK = 512

Consumer = Callable[[bytes], None]
OnFile = Callable[[str, int], Consumer | None]


class TarRefused(ValueError):
    """The stream is not a tar archive this reader reads within its bounds."""


_REGULAR = (b"0", b"\0", b"7")
_META = (b"x", b"g", b"L", b"K")


class TarStream:
    def __init__(
        self, on_file: OnFile, *, max_members: int = 10_000, max_meta_bytes: int = 64 * 1024
    ) -> None:
        self._on_file = on_file
        self._max_members = max_members
        self._max_meta = max_meta_bytes
        self._buf = bytearray()
        self._members = 0
        # What the bytes being read are: a header, a metadata entry, a file's data (`_sink`,
        # None: skipped) or the padding after either; `_left` bytes of it remain.
        self._state = "header"
        self._left = 0
        self._pad = 0
        self._sink: Consumer | None = None
        self._meta_kind = b""
        self._pending_name: str | None = None
        self._pending_size: int | None = None
        self.ended = False  # the end-of-archive marker was read

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self.ended:
            if self._state == "data":
                take = min(self._left, len(view))
                if self._sink is not None and take:
                    self._sink(bytes(view[:take]))
                view = view[take:]
                self._left -= take
                if self._left == 0:
                    self._state, self._left = "pad", self._pad
            elif self._state == "pad":
                take = min(self._left, len(view))
                view = view[take:]
                self._left -= take
                if self._left == 0:
                    self._state = "header"
            else:  # a header or a metadata entry: gathered whole, both bounded
                want = BLOCK if self._state == "header" else self._left
                take = min(want - len(self._buf), len(view))
                self._buf += view[:take]
                view = view[take:]
                if len(self._buf) == want:
                    block, self._buf = bytes(self._buf), bytearray()
                    if self._state == "header":
                        self._header(block)
                    else:
                        self._meta(block)

    def close(self) -> None:
        """The stream ended: refuse an archive cut inside an entry. (An archive without its
        end-of-archive blocks is accepted: some writers omit them.)"""
        if not self.ended and (self._buf or self._state not in ("header",)):
            raise TarRefused("the archive ends inside an entry")

    def _header(self, block: bytes) -> None:
        if block == bytes(BLOCK):
            self.ended = True
            return
        if not _stored_checksums(block[148:156]) & _checksums(block):
            raise TarRefused("a header's checksum does not match: not a tar archive")
        self._members += 1
        if self._members > self._max_members:
            raise TarRefused(f"the archive holds more than {self._max_members} entries")
        kind = block[156:157]
        size = _number(block[124:136])
        if self._pending_size is not None and kind not in _META:
            size = self._pending_size
        name = _name(block)
        if self._pending_name is not None and kind not in _META:
            name = self._pending_name
        pad = -size % BLOCK
        if kind in _META:
            if size > self._max_meta:
                raise TarRefused(
                    f"a metadata entry of {size} bytes is over the limit of {self._max_meta}"
                )
            self._meta_kind = kind
            self._state, self._left, self._pad = "meta", size + pad, pad
            if size + pad == 0:
                self._state = "header"
            return
        self._pending_name = self._pending_size = None
        sink = self._on_file(name, size) if kind in _REGULAR else None
        if kind in (b"1", b"2", b"3", b"4", b"5", b"6"):
            size, pad = 0, 0  # links, devices, directories and FIFOs carry no data (as tarfile)
        self._sink = sink  # other kinds: skipped by their size
        self._state, self._left, self._pad = "data", size, pad
        if size == 0:
            self._state, self._left = ("pad", pad) if pad else ("header", 0)

    def _meta(self, entry: bytes) -> None:
        body = entry[: len(entry) - self._pad] if self._pad else entry
        if self._meta_kind == b"L":
            self._pending_name = body.split(b"\0", 1)[0].decode("utf-8", "replace")
        elif self._meta_kind == b"x":
            for key, value in _pax_records(body):
                if key == "path":
                    self._pending_name = value
                elif key == "size":
                    if not value.isdigit():
                        raise TarRefused("a PAX size is not a number")
                    self._pending_size = int(value)
        self._state = "header"


def _checksums(block: bytes) -> set[int]:
    """The header's sum with its checksum field as spaces, unsigned and signed (old writers)."""
    rest = block[:148] + block[156:]
    signed = sum(b - 256 if b > 127 else b for b in rest)
    return {sum(rest) + 8 * 32, signed + 8 * 32}


def _stored_checksums(field: bytes) -> set[int]:
    try:
        value = _number(field)
    except TarRefused:
        return set()
    return {value}


def _number(field: bytes) -> int:
    """A numeric header field: octal ASCII, or GNU's base-256 (its first byte's high bit)."""
    if field and field[0] & 0x80:
        if field[0] == 0xFF:
            raise TarRefused("a negative size")
        value = field[0] & 0x7F
        for byte in field[1:]:
            value = value * 256 + byte
        return value
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarRefused("a header's number is not octal") from None


def _name(block: bytes) -> str:
    name = block[0:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar":
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "replace")


def _pax_records(body: bytes) -> list[tuple[str, str]]:
    """`LENGTH KEY=VALUE\\n` records; raises TarRefused on one that does not add up."""
    records = []
    pos = 0
    while pos < len(body):
        if body[pos:].strip(b"\0") == b"":
            break
        space = body.find(b" ", pos, pos + 20)
        if space < 0 or not body[pos:space].isdigit():
            raise TarRefused("a PAX record has no length")
        length = int(body[pos:space])
        record = body[space + 1 : pos + length]
        if length <= space - pos or pos + length > len(body) or not record.endswith(b"\n"):
            raise TarRefused("a PAX record's length does not match it")
        key, sep, value = record[:-1].partition(b"=")
        if not sep:
            raise TarRefused("a PAX record has no '='")
        records.append((key.decode("utf-8", "replace"), value.decode("utf-8", "replace")))
        pos += length
    return records
