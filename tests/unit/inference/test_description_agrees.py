"""The operator's description of an adapter file (`lora_volume.description`, from its header
alone: what a LoRAAdapter's status shows) agrees with what the server makes of the same file
(`/v1/adapters`): the same format key and target components for every served format, and the
same rank wherever the server serves the file's own low-rank pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_inference.pipeline import DiffusionBackend
from lora_volume import description, files

from tests.support.formats import write

# test_formats' float64 pipelines: a fixture, requested by name below
from tests.unit.inference.test_formats import FORMATS, float64_backends  # noqa: F401

# Served as the file's own pairs: the declared rank is the served one. A LoHa's Hadamard
# product, a LoKr's Kronecker product and a Tucker LoCon's core are served as pairs of their own.
SAME_RANK = ("lora", "lora_bias", "dora", "xlabs")


@pytest.mark.parametrize("case", list(FORMATS))
def test_the_status_describes_a_file_as_the_server_serves_it(
    case: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    arch, make, key = FORMATS[case]
    backends: dict[str, DiffusionBackend] = request.getfixturevalue("float64_backends")
    backend = backends[arch]
    made = make(backend.pipe)
    path = write(tmp_path / "a.safetensors", made.tensors, made.metadata)
    parsed = backend.parse_adapter(path, name=case, max_rank=64)
    declared = description.describe(files.read_safetensors_header(path), name=case)
    assert declared.format.key == parsed.format == key
    assert declared.targets == tuple(sorted({component for component, _ in parsed.layers}))
    assert declared.trigger_words == parsed.trigger_words
    if key in SAME_RANK:
        assert declared.rank == parsed.rank
    else:
        assert declared.rank <= parsed.rank
