"""The Dockerfiles, read rather than built (no Docker here): each image installs the extra that
pyproject.toml defines for it, runs as a non-root user, and has the entrypoint the chart
assumes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        result.append((word.upper(), rest.strip()))
    return result


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def copied_sources(image: str) -> set[str]:
    """What the image's Dockerfile copies from the build context."""
    return {
        source.rstrip("/")
        for word, arg in instructions(DOCKER / f"{image}.Dockerfile")
        if word == "COPY" and not arg.startswith("--from")
        for source in arg.split()[:-1]
    }


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize(("image", "extra"), [("operator", "operator"), ("inference", "inference")])
def test_image_installs_its_extra_from_pyproject(image: str, extra: str) -> None:
    extras = pyproject()["project"]["optional-dependencies"]
    assert extra in extras
    runs = " ".join(
        arg for word, arg in instructions(DOCKER / f"{image}.Dockerfile") if word == "RUN"
    )
    installed = re.findall(r"""\["optional-dependencies"\]\["([a-z,]+)"\]""", runs)
    assert installed == [extra], (
        f"{image}.Dockerfile should install the [{extra}] extra's dependencies, got {installed}"
    )


def test_operator_image_has_no_torch() -> None:
    text = (DOCKER / "operator.Dockerfile").read_text()
    extras = pyproject()["project"]["optional-dependencies"]
    assert not any(dep.startswith("torch") for dep in extras["operator"])
    install_lines = [
        arg for word, arg in instructions(DOCKER / "operator.Dockerfile") if word == "RUN"
    ]
    assert not any("torch==" in line or "install torch" in line for line in install_lines)
    assert "! pip show torch" in text, "the build fails if torch sneaks in through a dependency"


def test_inference_image_pins_the_torch_of_pyproject() -> None:
    extras = pyproject()["project"]["optional-dependencies"]
    pinned = next(dep for dep in extras["inference"] if dep.startswith("torch=="))
    runs = [arg for word, arg in instructions(DOCKER / "inference.Dockerfile") if word == "RUN"]
    assert any(f'"{pinned}"' in run or f" {pinned}" in run for run in runs), pinned


@pytest.mark.parametrize("image", ["operator", "inference"])
def test_image_runs_as_non_root(image: str) -> None:
    users = [arg for word, arg in final_stage(DOCKER / f"{image}.Dockerfile") if word == "USER"]
    assert users, f"{image}.Dockerfile's final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert uid == "65532" and gid in ("", "65532"), users[-1]


def test_dockerignore_keeps_the_context_small_and_the_sources_in() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for entry in (".venv", ".git", "demo-out", "tests", "bench", ".mypy_cache", ".pytest_cache"):
        assert entry in ignored, entry
    copied = copied_sources("operator") | copied_sources("inference")
    # devcluster/ is a development tool: left out, so changing it rebuilds no image. router/
    # goes into the operator image only (the router runs from it); playground/ (the page both
    # serve), runtime/ and podapi/ (what all three programs share) into both; the demo's trained
    # model into the inference image.
    assert copied == {
        "pyproject.toml",
        "README.md",
        "runtime",
        "podapi",
        "volume",
        "playground",
        "inference",
        "operator",
        "router",
        "models/shapes",
    }
    assert not copied & ignored


@pytest.mark.parametrize(
    ("image", "packages"),
    [
        ("operator", {"runtime", "podapi", "volume", "playground", "operator", "router"}),
        ("inference", {"runtime", "podapi", "volume", "playground", "inference", "models/shapes"}),
    ],
)
def test_each_image_copies_only_the_packages_it_runs(image: str, packages: set[str]) -> None:
    # The operator image must not hold the inference server: it would be one import away from
    # torch. The server needs nothing of the operator or the router.
    assert copied_sources(image) - {"pyproject.toml", "README.md"} == packages


def test_the_inference_image_carries_the_demo_model_where_the_demo_copies_it_from() -> None:
    from lora_demo import manifests

    steps = instructions(DOCKER / "inference.Dockerfile")
    copies = [arg.split() for word, arg in steps if word == "COPY" and arg.startswith("models/")]
    assert copies == [["models/shapes/", f"{manifests.SHAPES_IN_IMAGE}/"]]
    shipped = ROOT / "models" / "shapes"
    assert (shipped / manifests.DEMO_MODEL / "model_index.json").is_file()
    for source in manifests.DEMO_ADAPTERS:
        assert source.trained
        assert (shipped / "adapters" / source.name / "adapter_config.json").is_file()
