"""Every command and manifest in the README and docs/, run or dry-run as written.

Each fenced `sh`, `bash`, `yaml` or `python` block carries a marker on the line above it:

- `<!-- docs-test: run -->`: run as written (in a private network and mount namespace, with its
  own /tmp), and every command must succeed;
- `<!-- docs-test: dry-run (why) -->`: it needs what this machine lacks (GPU nodes, a registry, a
  model), so on the local cluster `helm install/upgrade` become `helm template | kubectl apply
  --dry-run=server` with the same values, `kubectl apply/create` get `--dry-run=server`, a
  manifest or values block is dry-run the same way, and every object a later command names
  (`deploy/...`, `svc/...`, `lora/...`, a release) must be one the block created; then the values
  must agree: each LoRAAdapter must target at least one inference pod the block deploys (its
  `baseModel` is the pod's served model, its selector matches the pod's labels), using the
  operator's own decision (`AdapterInfo.targets`);
- `<!-- docs-test: skip (why) -->`: neither, and why.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from lora_devcluster.harness import Harness
from lora_inference import cli as inference_cli
from lora_operator.rules import model

from tests.support import ROOT
from tests.support.chart import KUBE_VERSION, MONITORING_CRDS, in_cluster, server_dry_run
from tests.support.docs import (
    MY_REGISTRY_VALUES,
    Block,
    commands,
    helm_values_args,
    parse_blocks,
    written_by,
)

DOCS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted(
        p for p in (ROOT / "docs").rglob("*.md") if p.name not in ("devcluster.md", "images.md")
    ),
]
CHECKED = {"sh", "bash", "yaml", "python"}
ALIASES = {
    "deploy": "Deployment",
    "svc": "Service",
    "lora": "LoRAAdapter",
    "crd": "CRD",
    "job": "Job",
}

Obj = dict[str, Any]


ALL_BLOCKS = [b for doc in DOCS for b in parse_blocks(doc, doc.read_text()) if b.lang in CHECKED]


def _of(mode: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.mode == mode]


def test_every_command_block_is_marked() -> None:
    unmarked = [b.id for b in ALL_BLOCKS if b.mode is None]
    assert unmarked == [], f"blocks without a <!-- docs-test: ... --> marker: {unmarked}"
    unexplained = [b.id for b in ALL_BLOCKS if b.mode != "run" and not b.reason]
    assert unexplained == [], f"dry-run and skip markers need a reason: {unexplained}"
    assert _of("run") and _of("dry-run"), "the test must cover something"


def test_commands_parse_shell_lines() -> None:
    text = "helm install a b \\\n  --set x=1   # note\ncurl -s u | python3 -c 'p'\nsleep 1 &\n"
    assert list(commands(text)) == [
        ["helm", "install", "a", "b", "--set", "x=1"],
        ["curl", "-s", "u"],
        ["sleep", "1"],
    ]


# ---- dry-run


@dataclass
class Page:
    """What one block's dry run created, and the values it rendered."""

    namespace: str
    objects: list[Obj] = field(default_factory=list)
    releases: set[str] = field(default_factory=set)

    def names(self, kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.objects if o.get("kind") == kind}


def _flag_value(words: list[str], *names: str) -> str | None:
    for i, w in enumerate(words):
        for name in names:
            if w == name and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(name + "="):
                return w.split("=", 1)[1]
    return None


def _render_chart(h: Harness, release: str, chart: str, values: list[str], ns: str) -> str:
    argv = ["helm", "template", release, chart, "-n", ns, "--set", "crds.enabled=false"]
    argv += ["--kube-version", KUBE_VERSION]
    proc = in_cluster(h, [*argv, *values])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _docs(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d]


def _dry_run_command(h: Harness, page: Page, words: list[str], block: Block) -> None:
    ns = page.namespace
    if words[0] == "helm":
        verb = words[1]
        if verb in ("install", "upgrade"):
            positional = [w for w in words[2:] if not w.startswith("-")]
            release, chart = positional[0], positional[1]
            if chart.startswith("oci://") and chart.rsplit("/", 1)[1] == "lora-operator":
                # The chart as `make chart-push` publishes it (tests/e2e/test_push.py): the
                # working tree's.
                chart = "charts/lora-operator"
            assert _flag_value(words, "-n", "--namespace") == "lora", (block.id, words)
            values = helm_values_args(words, written_by(block.doc))
            rendered = _render_chart(h, release, chart, values, ns)
            server_dry_run(h, ns, rendered)
            page.objects += _docs(rendered)
            page.releases.add(release)
        else:  # test, uninstall, get values: the release the block installed
            named = words[3] if verb == "get" else words[2]
            assert named in page.releases or not page.releases, (block.id, words)
        return
    if words[0] != "kubectl":
        return  # curl, python3, buildah, make: they need the running release
    args = list(words[1:])
    if "-n" in args:
        i = args.index("-n")
        del args[i : i + 2]
    verb = args[0]
    if args[:2] == ["create", "namespace"]:
        assert args[2] == ns, (block.id, words)
        return  # the namespace the docs use exists (the lora_namespace fixture)
    if verb in ("apply", "create"):
        files = [args[i + 1] for i, a in enumerate(args) if a == "-f"]
        for f in files:
            path = ROOT / f
            texts = (
                [p.read_text() for p in sorted(path.glob("*.yaml"))]
                if path.is_dir()
                else [path.read_text()]
            )
            page.objects += [d for t in texts for d in _docs(t)]
        cmd = ["kubectl", "-n", ns, *args, "--dry-run=server"]
        if "--server-side" in args:
            return  # the CRD: the session cluster already has it (crds fixture)
        proc = in_cluster(h, cmd)
        assert proc.returncode == 0, (block.id, words, proc.stderr)
        return
    for ref in (a for a in args[1:] if re.match(r"^[a-z]+/[a-z0-9.-]+$", a)):
        kind, name = ref.split("/", 1)
        if ALIASES.get(kind) == "CRD":
            continue
        assert name in page.names(ALIASES.get(kind, kind)), (
            f"{block.id}: {ref} is not created above"
        )
    if verb in ("describe", "get") and len(args) > 2 and args[1] == "lora":
        assert args[2] in page.names("LoRAAdapter"), f"{block.id}: lora {args[2]} is not created"


def _inference_pods(page: Page) -> list[tuple[model.PodInfo, str]]:
    """Each inference Deployment's pod as the operator would see it, with its served model."""
    pods = []
    for d in page.objects:
        if d.get("kind") != "Deployment":
            continue
        template = d["spec"]["template"]
        if template["metadata"].get("labels", {}).get("lora.dev/inference") is None:
            continue
        args = [
            a.replace("$(POD_NAMESPACE)", page.namespace)
            for a in template["spec"]["containers"][0]["args"]
        ]
        served = inference_cli.build_parser().parse_args(args).served_model_name
        body = {
            "metadata": {
                **template["metadata"],
                "namespace": page.namespace,
                "name": d["metadata"]["name"],
            },
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        pods.append((model.pod_info(body), served))
    return pods


def _check_agreement(page: Page, block: Block) -> None:
    pods = _inference_pods(page)
    for adapter in (o for o in page.objects if o.get("kind") == "LoRAAdapter"):
        info = model.adapter_info(
            {**adapter, "metadata": {**adapter["metadata"], "namespace": page.namespace}}
        )
        targeted = [p.name for p, served in pods if info.targets(p, served)]
        if pods:
            assert targeted, (
                f"{block.id}: LoRAAdapter {info.name} (baseModel {info.base_model}) targets no "
                f"inference pod the block deploys: {[(p.name, s, dict(p.labels)) for p, s in pods]}"
            )


@pytest.fixture
def lora_namespace(devcluster: Harness, crds: Harness) -> Iterator[str]:
    """The namespace the docs use (`lora`), with the chart's CRDs (the crds fixture) and the
    Prometheus Operator stand-ins; deleted after each block."""
    devcluster.kubectl("apply", "-f", str(MONITORING_CRDS))
    devcluster.kubectl("create", "namespace", "lora")
    try:
        yield "lora"
    finally:
        devcluster.kubectl("delete", "namespace", "lora", "--wait=false")
        devcluster.kubectl("wait", "--for=delete", "namespace/lora", "--timeout=120s")


@pytest.mark.parametrize("block", _of("dry-run"), ids=lambda b: b.id)
def test_dry_run_blocks(devcluster: Harness, lora_namespace: str, block: Block) -> None:
    page = Page(lora_namespace)
    if block.lang == "yaml":
        docs = _docs(block.text)
        if all("kind" in d for d in docs):
            server_dry_run(devcluster, lora_namespace, block.text)
        else:  # chart values
            values = ROOT / ".pytest-docs-values.yaml"
            values.write_text(block.text)
            try:
                rendered = _render_chart(
                    devcluster,
                    "lora-operator",
                    "charts/lora-operator",
                    ["-f", MY_REGISTRY_VALUES, "-f", str(values)],
                    lora_namespace,
                )
            finally:
                values.unlink()
            server_dry_run(devcluster, lora_namespace, rendered)
        return
    if block.doc.name in ("operations.md", "add-an-adapter.md", "back-up-the-adapter-volume.md"):
        # Commands on an installed release: the README's install comes first.
        readme = next(b for b in _of("dry-run") if b.doc.name == "README.md")
        for words in commands(readme.text):
            _dry_run_command(devcluster, page, words, readme)
    for words in commands(block.text):
        _dry_run_command(devcluster, page, words, block)
    _check_agreement(page, block)


# ---- run


@pytest.mark.parametrize("block", _of("run"), ids=lambda b: b.id)
def test_run_blocks(block: Block) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for a private network and mount namespace")
    if ROOT.is_relative_to("/tmp"):
        pytest.skip("the block's own /tmp would hide this checkout")
    # The block's /tmp is a fresh tmpfs and its network its own (its ports collide with nothing),
    # so the script itself lives in /dev/shm; background jobs are ended when it exits.
    script = Path("/dev/shm") / f"docs-block-{os.getpid()}.sh"
    script.write_text("set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + block.text)
    wrapper = (
        f"ip link set lo up && mount -t tmpfs tmpfs /tmp && cd {shlex.quote(str(ROOT))} "
        f"&& exec bash {shlex.quote(str(script))}"
    )
    try:
        proc = subprocess.run(
            ["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c", wrapper],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        script.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    if "/v1/images/generations" in block.text:
        assert '"b64_json"' in proc.stdout, proc.stdout[-2000:]
