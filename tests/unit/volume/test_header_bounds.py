"""The bounds on a safetensors header and the JSON in adapter files: realistic large headers
pass, every bomb is refused with a message that says what is wrong, and refusing one spends
little memory (measured in a child process, on the server's way of reading: the whole file in
memory; the operator's staging is measured in tests/unit/operator/test_staging_bombs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from lora_volume import description, errors, files

from tests.support import bombs

MIB = 1024 * 1024


def check_as_staging_does(path: Path) -> description.Description:
    """What the operator's store does with a download (publishing.describe_file)."""
    return description.describe(files.read_safetensors_header(path, name="x"), name="x")


def check_as_the_server_does(path: Path) -> files.SafetensorsHeader:
    """What the server does before it opens the tensors (lora_inference.parsing)."""
    data = path.read_bytes()
    header = files.parse_safetensors_header(data, len(data), name="x")
    files.trigger_words(header)
    files.check_lora_keys(list(header.tensors), name="x")
    return header


@pytest.mark.parametrize(
    ("modules", "tensors", "thumbnail"),
    [
        pytest.param(bombs.flux_modules, bombs.LORA, 0, id="flux-lora-every-layer-r128"),
        pytest.param(bombs.sdxl_modules, bombs.LOHA_DORA, 256 * 1024, id="sdxl-loha-dora-r128"),
    ],
)
def test_the_largest_real_headers_pass_well_within_the_limits(
    modules: Callable[[], list[bombs.Module]], tensors: bombs.TensorKinds, thumbnail: int
) -> None:
    header, data_size = bombs.header_json(
        modules(), tensors, rank=128, metadata=bombs.kohya_metadata(8000, thumbnail_bytes=thumbnail)
    )
    # Only the header is in memory: the data is a size (1.5 GiB and more).
    parsed = files.parse_safetensors_header(
        bombs.safetensors_file(header), 8 + len(header) + data_size
    )
    assert len(parsed.tensors) >= 1600
    assert len(header) * 5 <= files.MAX_HEADER_BYTES
    assert "subject" in files.trigger_words(parsed)  # the tag frequency parses too
    described = description.describe(parsed)
    assert described.rank == 128


@pytest.mark.parametrize("bomb", bombs.bombs(), ids=lambda b: b.name)
def test_each_bomb_is_refused_saying_why(tmp_path: Path, bomb: bombs.Bomb) -> None:
    path = bombs.write_bomb(tmp_path, bomb)
    for check in (check_as_staging_does, check_as_the_server_does):
        with pytest.raises(errors.InvalidAdapter) as e:
            check(path)
        assert bomb.message in e.value.message, check.__name__


@pytest.mark.parametrize(
    ("header", "kind", "message"),
    [
        pytest.param(
            bombs.nesting_bomb(5000),
            errors.InvalidJson,
            "x is not a valid safetensors file (its header nests deeper than 3 levels); "
            "re-export or re-download it",
            id="nesting",
        ),
        pytest.param(
            bombs.list_bomb(2 * MIB),
            errors.InvalidJson,
            "x is not a valid safetensors file (its header holds more than 250000 values, more "
            "than any adapter needs); re-export or re-download it",
            id="values",
        ),
        pytest.param(
            bombs.long_number(5000),
            errors.InvalidJson,
            "x is not a valid safetensors file (its header has a number 5000 characters long at "
            "character 29, over the limit of 20); re-export or re-download it",
            id="number",
        ),
        pytest.param(
            b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}\xff',
            errors.InvalidJson,
            "x is not a valid safetensors file (its header is not UTF-8 text (invalid start "
            "byte at byte 54)); re-export or re-download it",
            id="not-utf8",
        ),
        pytest.param(
            b'{"t":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}',
            errors.InvalidAdapter,
            "tensor 't' has an invalid shape [True]",
            id="bool-dimension",
        ),
        pytest.param(
            b'{"__metadata__":{"a":{"b":"c"}}}',
            errors.InvalidAdapter,
            "__metadata__ must map strings to strings",
            id="metadata-not-strings",
        ),
        pytest.param(
            b'{"__metadata__":{"a":{"b":["c"]}}}',
            errors.InvalidJson,
            "its header nests deeper than 3 levels",
            id="metadata-nested",
        ),
    ],
)
def test_each_header_refusal_has_its_message(
    header: bytes, kind: type[errors.InvalidAdapter], message: str
) -> None:
    blob = bombs.safetensors_file(header, b"\0" * 4)
    with pytest.raises(kind) as e:
        files.parse_safetensors_header(blob, len(blob), name="x")
    assert message in e.value.message


def test_a_header_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """The declared length alone refuses it: the bytes after the length are never read (here
    they are not even JSON)."""
    path = tmp_path / "big.safetensors"
    declared = files.MAX_HEADER_BYTES + 1
    path.write_bytes(bombs.safetensors_file(b"\xff" * declared))
    with pytest.raises(errors.InvalidJson) as e:
        files.read_safetensors_header(path, name="big.safetensors")
    assert e.value.message == (
        f"big.safetensors has a safetensors header of {declared} bytes, over the limit of "
        f"{files.MAX_HEADER_BYTES} (8 MiB); a LoRA's header takes well under 2 MiB: save the "
        "file again without large metadata (embedded images, captions)"
    )


def test_a_header_longer_than_its_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(bombs.safetensors_file(b"{}")[:-1])
    with pytest.raises(errors.InvalidAdapter) as e:
        files.read_safetensors_header(path, name="short.safetensors")
    assert e.value.message == (
        "short.safetensors is not a valid safetensors file (its header declares 2 bytes, more "
        "than the 9-byte file holds: the file is truncated or not safetensors); re-export or "
        "re-download it"
    )


def test_lora_metadata_within_its_bounds(tmp_path: Path) -> None:
    """diffusers' LoRA config in the header is JSON too: bounded as the header, refused with
    the same error; kohya's tag frequency is informational: a bomb there gives no words."""
    bomb = "[" * 100 + "]" * 100
    header = files.SafetensorsHeader(
        tensors={},
        metadata={files.LORA_METADATA_KEY: bomb, "ss_tag_frequency": bomb},
    )
    with pytest.raises(errors.InvalidJson) as e:
        files.lora_metadata(header, name="a")
    assert e.value.message == (
        "the lora_adapter_metadata header of adapter 'a' nests deeper than 16 levels"
    )
    assert files.trigger_words(header) == ()
    listed = "[" + "0," * 300_000 + "0]"
    assert files.trigger_words(files.SafetensorsHeader({}, {"ss_tag_frequency": listed})) == ()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        pytest.param(
            b"[" * 100 + b"]" * 100, "adapter_config.json nests deeper than 16 levels", id="nested"
        ),
        pytest.param(
            b'{"r": ' + b"9" * 5000 + b"}",
            "adapter_config.json has a number 5000 characters long",
            id="number",
        ),
        pytest.param(
            b'{"target_modules": [' + b'"q",' * 300_000 + b'"v"]}',
            "adapter_config.json is 1200025 bytes, over the limit of 1048576 (1 MiB); peft "
            "writes a few KB: keep only its configuration",
            id="size",
        ),
        pytest.param(
            b'{"rank_pattern": {' + b'"":{},' * 120_000 + b'"":{}}}',
            "adapter_config.json holds more than 100000 values",
            id="values",
        ),
        pytest.param(b"{", "adapter_config.json is not JSON: expected a string key", id="syntax"),
        pytest.param(b"[]", "adapter_config.json must hold a JSON object", id="not-an-object"),
    ],
)
def test_adapter_config_within_its_bounds(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / files.ADAPTER_CONFIG).write_bytes(content)
    with pytest.raises(errors.InvalidAdapter) as e:
        files.read_adapter_config(tmp_path)
    assert message in e.value.message


# The server's way: the whole file in memory (it reads the tensors from the same bytes), then
# the header parsed where it lies. What refusing costs is the peak growth of the process past
# the file's own bytes.
SERVER_CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from lora_volume import errors, files

    def peak_kib():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    data = Path(sys.argv[1]).read_bytes()
    before = peak_kib()
    try:
        header = files.parse_safetensors_header(data, len(data), name="x")
        files.trigger_words(header)
        files.check_lora_keys(list(header.tensors), name="x")
        refused = None
    except errors.InvalidAdapter as e:
        refused = e.message
    print(json.dumps({"before": before, "after": peak_kib(), "refused": refused}))
    """
)
# The header's text decoded (8 MiB at most here: ASCII), and its largest string at 4 bytes a
# character (32 MiB), or 250000 values (tens of MiB): the most any header within the limits
# costs, with room for the allocator.
SERVER_BOUND_MIB = 64


@pytest.mark.parametrize("bomb", bombs.bombs(), ids=lambda b: b.name)
def test_refusing_a_bomb_costs_the_server_little_memory(tmp_path: Path, bomb: bombs.Bomb) -> None:
    path = bombs.write_bomb(tmp_path, bomb)
    out = subprocess.run(
        [sys.executable, "-c", SERVER_CHILD, str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    result = json.loads(out.stdout)
    grown_mib = (result["after"] - result["before"]) / 1024
    print(f"{bomb.name}: parsing grew the peak RSS by {grown_mib:.1f} MiB")
    assert bomb.message in result["refused"]
    assert grown_mib <= SERVER_BOUND_MIB
