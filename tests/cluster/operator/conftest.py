"""Fixtures for the operator on the local cluster: the CRD installed, the tiny model the pods
serve, a host directory as the adapter volume, and the operator as a real process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from diffusers import DiffusionPipeline
from lora_demo import release
from lora_devcluster.harness import Harness
from lora_inference.tools.tiny_models import write_tiny_model

from tests.support.cluster import MODEL_NAME, Models, Operator, readable_by_pods


@pytest.fixture(scope="session", autouse=True)
def crd(devcluster: Any) -> Any:
    """The cluster with the LoRAAdapter CRD installed and established: every test here needs
    it, including one that runs alone and starts its own operator."""
    release.install_crd(devcluster)
    return devcluster


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("models")
    write_tiny_model(root / MODEL_NAME, "sd15")
    readable_by_pods(root)
    pipe = DiffusionPipeline.from_pretrained(str(root / MODEL_NAME))
    return Models(root=root, pipe=pipe)


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    v = tmp_path / "volume"
    v.mkdir()
    return v


@pytest.fixture
def operator(
    devcluster: Harness, devcluster_namespace: str, volume: Path, tmp_path: Path
) -> Iterator[Operator]:
    op = Operator(volume=volume, namespaces=[devcluster_namespace], log_path=tmp_path / "op.log")
    with op.running():
        yield op
