"""The chart's images fail closed: no registry is named by default, an install that names none
fails saying which value to set, and every install and upgrade line of the docs names one (each
rendered here with `helm template`, as the docs have it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lora_demo import manifests

from tests.support import ROOT
from tests.support.chart import CHART, FULLNAME, NAMESPACE, RELEASE, Obj, render, run_helm
from tests.support.docs import commands, helm_values_args, parse_blocks, written_by

APP_VERSION = str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])
TASKS = sorted((ROOT / "docs" / "tasks").glob("*.md"))
# Pages besides the tasks whose install lines a reader copies.
PAGES = [*TASKS, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MESSAGE = "image.registry is required"


def _bare_template(helm: str, *args: str) -> tuple[int, str]:
    """`helm template` with no registry unless `args` name one."""
    proc = run_helm(helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, *args)
    return proc.returncode, proc.stdout + proc.stderr


def _images(docs: list[Obj]) -> dict[str, str]:
    """Each workload's (and the test pod's) first container's image, by object name."""
    out = {}
    for d in docs:
        spec = d.get("spec", {})
        pod = spec.get("template", {}).get("spec", spec)
        if d["kind"] == "Job":
            pod = spec["template"]["spec"]
        if pod.get("containers"):
            out[d["metadata"]["name"]] = pod["containers"][0]["image"]
    return out


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--set", "image.registry="],
        # One image named is not enough while the other still needs the registry.
        ["--set", "operator.image.repository=r.example/op"],
        ["--set", "inference.image.repository=r.example/inf"],
    ],
    ids=["nothing", "empty", "operator-only", "inference-only"],
)
def test_without_a_registry_the_chart_refuses_and_says_what_to_set(
    helm: str, flags: list[str]
) -> None:
    code, out = _bare_template(helm, *flags)
    assert code != 0, "rendered without a registry"
    assert _MESSAGE in out, out
    assert "examples/values-my-registry.yaml" in out, out
    assert "someone else published" in out, out


def test_the_registry_names_every_image_and_the_tag_is_the_app_version(helm: str) -> None:
    docs = render(helm, "--set", "image.registry=r.example:5000/team/")
    images = _images(docs)
    operator = f"r.example:5000/team/lora-operator/operator:{APP_VERSION}"
    inference = f"r.example:5000/team/lora-operator/inference:{APP_VERSION}"
    assert images[f"{FULLNAME}-operator"] == operator
    assert images[f"{FULLNAME}-router"] == operator
    assert images[f"{FULLNAME}-test-health"] == operator
    assert images[f"{FULLNAME}-inference"] == inference
    # The admin token's hook Job too: no image of the chart comes from anywhere else.
    assert set(images.values()) == {operator, inference}
    assert len(images) == 5, images


def test_each_images_own_repository_needs_no_registry(helm: str) -> None:
    code, out = _bare_template(
        helm,
        *("--set", "operator.image.repository=r.example/op", "--set", "operator.image.tag=t"),
        *("--set", "inference.image.repository=r.example/inf"),
    )
    assert code == 0, out
    images = _images([d for d in yaml.safe_load_all(out) if d])
    assert images[f"{FULLNAME}-operator"] == "r.example/op:t"
    assert images[f"{FULLNAME}-inference"] == f"r.example/inf:{APP_VERSION}"
    # Without the inference pods, the operator's image alone is enough.
    code, out = _bare_template(
        helm, "--set", "operator.image.repository=r.example/op", "--set", "inference.enabled=false"
    )
    assert code == 0, out


def _installs(page: Path) -> list[list[str]]:
    """The page's `helm install`/`upgrade`/`template` lines of this chart, from its shell
    blocks (any marker)."""
    found = []
    for block in parse_blocks(page, page.read_text()):
        if block.lang != "sh":
            continue
        for words in commands(block.text):
            if words[:3] == ["lora-devcluster", "exec", "--"]:
                words = words[3:]  # the command the local cluster runs
            if words[:1] != ["helm"] or len(words) < 2:
                continue
            if words[1] not in ("install", "upgrade", "template"):
                continue
            positional = [w for w in words[2:] if not w.startswith("-")]
            chart = positional[1] if len(positional) > 1 else ""
            if chart == "charts/lora-operator" or (
                chart.startswith("oci://") and chart.endswith("/lora-operator")
            ):
                found.append(words)
    return found


def test_every_task_page_that_installs_is_found() -> None:
    pages = {p.name for p in TASKS if _installs(p)}
    # Every task page installs or upgrades the chart somewhere.
    assert pages == {p.name for p in TASKS}, sorted({p.name for p in TASKS} - pages)


@pytest.mark.parametrize(
    ("page", "words"),
    [(page, words) for page in PAGES for words in _installs(page)],
    ids=lambda x: x.name if isinstance(x, Path) else " ".join(x)[:60],
)
def test_each_docs_install_line_names_a_registry_and_renders(
    helm: str, page: Path, words: list[str]
) -> None:
    values = helm_values_args(words, written_by(page))
    absolute = [
        str(ROOT / v) if i and values[i - 1] in ("-f", "--values") else v
        for i, v in enumerate(values)
    ]
    code, out = _bare_template(helm, *absolute)
    assert code == 0, f"{page.relative_to(ROOT)}: {' '.join(words)}\n{out[-2000:]}"


def test_the_local_clusters_images_are_the_docs_file(helm: str, tmp_path: Path) -> None:
    """examples/local/values-images.yaml (docs/devcluster.md) and the suite's own values name
    the same images, which render with no registry."""
    documented = yaml.safe_load((ROOT / "examples" / "local" / "values-images.yaml").read_text())
    assert {role: documented[role]["image"] for role in documented} == manifests.LOCAL_IMAGES
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(manifests.local_values("ns", replicas=1)))
    code, out = _bare_template(helm, "-f", str(values))
    assert code == 0, out
    images = _images([d for d in yaml.safe_load_all(out) if d])
    assert images[f"{FULLNAME}-operator"] == f"docker.io/lora-operator/operator:{APP_VERSION}"
    assert images[f"{FULLNAME}-inference"] == f"docker.io/lora-operator/inference:{APP_VERSION}"
