"""The README's GPU quickstart, run as written on a local cluster of its own.

The quickstart's shell blocks are taken from the README and changed only by the replacements
docs/devcluster.md lists ("The README's quickstart on the local cluster": the registry's
address and plain HTTP, the GPU values and the Hub downloads swapped for the small model the
inference image carries), then run as one script each, inside the cluster's network namespace,
as a user would after `lora-devcluster up --registry`: the images are pushed to the cluster's
registry, the chart is pushed and installed from it, and the node runs only what it pulled
(its node imports none of the project's pushed images).

This cluster is the test's own (a fresh cluster, as the README's user has: its CRD comes from the
chart), so it runs after the session's cluster has stopped (the `own_cluster` marker): two
nodes each holding the 5 GB inference image would not fit the disk.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from lora_devcluster import images, registry
from lora_devcluster.harness import Harness
from lora_devcluster.pytest_plugin import running_cluster
from PIL import Image

from tests.support import ROOT
from tests.support.chart import unavailable
from tests.support.docs import Block, parse_blocks, run_script

README = ROOT / "README.md"
SECTION = "## Quickstart on a GPU cluster"
OVERRIDES = ROOT / "docs" / "devcluster.md"
OVERRIDES_SECTION = "## The README's quickstart on the local cluster"
NAMESPACE = "lora"  # the README's
_ROW = re.compile(r"^\| `([^`]+)` \| `([^`]+)` \|")

pytestmark = pytest.mark.own_cluster


def _section(path: Path, heading: str) -> tuple[int, int]:
    """The 1-based line range of the Markdown section under `heading` (to the next `## `)."""
    lines = path.read_text().splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return start + 1, end


def quickstart_blocks() -> list[Block]:
    first, last = _section(README, SECTION)
    return [
        b
        for b in parse_blocks(README, README.read_text())
        if b.lang == "sh" and first <= b.line <= last
    ]


def replacements() -> list[tuple[str, str]]:
    """docs/devcluster.md's table: (in the README, on the local cluster), in order."""
    first, last = _section(OVERRIDES, OVERRIDES_SECTION)
    lines = OVERRIDES.read_text().splitlines()[first:last]
    return [(m.group(1), m.group(2)) for line in lines if (m := _ROW.match(line))]


def localized(text: str, rows: list[tuple[str, str]]) -> str:
    for readme, local in rows:
        text = text.replace(readme, local)
    return text


def test_the_documented_replacements_cover_what_the_local_cluster_lacks() -> None:
    """Every replacement is used, and after them nothing names the example registry, a GPU
    values file, the Hub or an SDXL size: the rest of each block runs as the README has it."""
    blocks, rows = quickstart_blocks(), replacements()
    assert len(blocks) == 2 and len(rows) >= 8, (blocks, rows)
    text = "\n".join(b.text for b in blocks)
    unused = [readme for readme, _ in rows if readme not in text]
    assert unused == [], f"replacements that match nothing in the README: {unused}"
    local = localized(text, rows)
    for gone in ("registry.example.com", "sdxl", "adapter-hf", "1024x1024", "pixel-art-xl"):
        assert gone not in local, (gone, local)
    assert f"REGISTRY={registry.ADDRESS}/" in local
    for path in re.findall(r"examples/[\w./-]+\.yaml", local):
        assert (ROOT / path).is_file(), path


def test_the_readme_quickstart_runs_as_written_on_a_local_cluster(tmp_path: Path) -> None:
    rows = replacements()
    build, install = (localized(b.text, rows) for b in quickstart_blocks())
    # The install block writes out.png where it runs: a folder of its own with the examples,
    # not the checkout (whose untracked files would change the images' keys).
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    try:
        # Built beforehand (`make test` and the docs do): inside the cluster's network namespace
        # the README's `make images` finds them, as building would need the package index.
        images.built(images.PUSHED_IMAGES)
    except images.ImageError as e:
        unavailable(str(e))
    with running_cluster(roles=("base", "pause")) as h:
        run_script(build, ROOT, tmp_path / "build.log", timeout=1200, env=h.env)
        run_script(install, work, tmp_path / "install.log", timeout=1500, env=h.env)
        _check_what_the_quickstart_left(h, work)


def _check_what_the_quickstart_left(h: Harness, work: Path) -> None:
    # The image the README's curl saved: the model's size.
    image = Image.open(io.BytesIO((work / "out.png").read_bytes()))
    assert image.format == "PNG" and image.size == (32, 32), (image.format, image.size)
    adapter = json.loads(h.kubectl("get", "lora", "pixel-art", "-n", NAMESPACE, "-o", "json"))
    assert adapter["status"]["phase"] == "Ready", adapter["status"]
    # Every container ran an image pulled from the cluster's registry: the node has no other.
    pods = h.pods(NAMESPACE, "app.kubernetes.io/name=lora-operator")
    assert {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods} >= {
        "operator",
        "inference",
    }
    for pod in pods:
        for status in pod["status"].get("containerStatuses", []):
            assert status["imageID"].startswith(f"{registry.ADDRESS}/lora-operator/"), status
    # The chart came from the registry too.
    release = json.loads(h.run(["helm", "list", "-n", NAMESPACE, "-o", "json"]))
    assert [r["name"] for r in release] == ["lora-operator"], release
