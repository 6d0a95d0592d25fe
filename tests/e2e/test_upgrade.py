"""Upgrading from the last release (its git tag `vX.Y.Z`) to this tree, as docs/tasks/upgrade.md
promises: every object the previous CRD accepted is valid under this one (a structural proof over
the schema keywords the CRD uses), and, on the cluster, `helm upgrade` from the previous chart
to this one under generation traffic answers every request and keeps every adapter Ready.

The previous chart comes from git (`git archive <tag> charts/lora-operator`); the images are this
tree's, so the test covers what the chart and the upgrade do to running pods, not an image built
from the tag."""

from __future__ import annotations

import base64
import copy
import re
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from lora_demo import manifests, release
from lora_demo.manifests import RELEASE, AdapterSource
from lora_devcluster.harness import Harness

from tests.support.phases import Phase

ROOT = Path(__file__).resolve().parents[2]
CRD = "crds/lora.dev_loraadapters.yaml"
Schema = dict[str, Any]

# ---- the schema check (pure)

# Keywords that change which objects a schema accepts, and those that do not. A keyword in
# neither list fails the check, so a CRD that starts using one extends the check first.
_IGNORED = {"description", "default", "example", "x-kubernetes-list-map-keys"}
_CHECKED = {
    "type",
    "properties",
    "required",
    "items",
    "additionalProperties",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "format",
    "nullable",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
}


def narrowings(old: Schema, new: Schema, path: str = "") -> list[str]:
    """Where `new` may refuse an object `old` accepts (pure): [] proves that every object valid
    under `old` is valid under `new`, for the keywords in _CHECKED. Each finding names the path
    and the keyword."""
    found: list[str] = []
    here = path or "."
    for schema in (old, new):
        unknown = set(schema) - _CHECKED - _IGNORED
        if unknown:
            found.append(f"{here}: keywords the check does not know: {sorted(unknown)}")
    if old.get("type") != new.get("type") and "type" in new:
        found.append(f"{here}: type {old.get('type')} -> {new.get('type')}")
    for key in ("x-kubernetes-int-or-string", "nullable"):
        if old.get(key) and not new.get(key):
            found.append(f"{here}: {key} dropped")
    if old.get("x-kubernetes-preserve-unknown-fields") and not new.get(
        "x-kubernetes-preserve-unknown-fields"
    ):
        found.append(f"{here}: unknown fields no longer preserved")
    old_props, new_props = old.get("properties") or {}, new.get("properties") or {}
    for name, sub in old_props.items():
        if name not in new_props:
            if not new.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{here}.{name}: removed")
            continue
        found += narrowings(sub, new_props[name], f"{path}.{name}")
    added_required = set(new.get("required") or []) - set(old.get("required") or [])
    if added_required:
        found.append(f"{here}: newly required {sorted(added_required)}")
    if isinstance(old.get("items"), dict) and isinstance(new.get("items"), dict):
        found += narrowings(old["items"], new["items"], f"{path}[]")
    elif "items" in new and "items" not in old:
        found.append(f"{here}: items constrained")
    old_ap, new_ap = old.get("additionalProperties", True), new.get("additionalProperties", True)
    if isinstance(new_ap, dict):
        if isinstance(old_ap, dict):
            found += narrowings(old_ap, new_ap, f"{path}{{*}}")
        else:
            found.append(f"{here}: additionalProperties constrained")
    elif new_ap is False and old_ap is not False:
        found.append(f"{here}: additionalProperties refused")
    if "enum" in new and not set(map(repr, old.get("enum", []))) <= set(map(repr, new["enum"])):
        found.append(f"{here}: enum {old.get('enum')} -> {new['enum']}")
    for key, looser in (
        ("minimum", min),
        ("exclusiveMinimum", min),
        ("minLength", min),
        ("minItems", min),
        ("maximum", max),
        ("exclusiveMaximum", max),
        ("maxLength", max),
        ("maxItems", max),
    ):
        if key in new and (key not in old or looser(old[key], new[key]) != new[key]):
            found.append(f"{here}: {key} {old.get(key)} -> {new[key]}")
    for key in ("pattern", "format", "x-kubernetes-list-type"):
        if key in new and new.get(key) != old.get(key):
            found.append(f"{here}: {key} {old.get(key)!r} -> {new[key]!r}")
    old_rules = [r["rule"] for r in old.get("x-kubernetes-validations") or []]
    for rule in new.get("x-kubernetes-validations") or []:
        if not _rule_admits_the_old(rule["rule"], old_rules):
            found.append(f"{here}: new validation rule {rule['rule']!r}")
    return found


_STARTS_WITH = re.compile(r"^self\.startsWith\('([^'\\]*)'\)$")
_UNLESS_STARTS_WITH = re.compile(r"^!self\.startsWith\('([^'\\]*)'\)$")


def _disjuncts(rule: str) -> list[str]:
    return [d.strip() for d in rule.split("||")]


def _rule_admits_the_old(rule: str, old_rules: list[str]) -> bool:
    """Whether a validation rule passes every value the old rules passed, in the two forms a
    rule may widen in (pure; any other rule not already there is a narrowing):
    - an old rule with disjuncts added (`a || b` -> `a || b || c`);
    - `!self.startsWith('P') || ...`: a rule only for values starting with P, when an old rule
      of `self.startsWith(...)` disjuncts refused every such value (no prefix of it is P's, and
      P is no prefix of one of them), such as a new scheme's own rule."""
    new = _disjuncts(rule)
    if rule in old_rules or any(set(_disjuncts(o)) <= set(new) for o in old_rules):
        return True
    guard = _UNLESS_STARTS_WITH.match(new[0])
    if guard is None:
        return False
    prefix = guard.group(1)
    for old in old_rules:
        starts = [_STARTS_WITH.match(d) for d in _disjuncts(old)]
        if all(starts) and not any(
            prefix.startswith(m.group(1)) or m.group(1).startswith(prefix) for m in starts if m
        ):
            return True
    return False


def crd_narrowings(old_crd: Schema, new_crd: Schema) -> list[str]:
    """narrowings() for every version the old CRD served (pure); a version no longer served is
    one too."""
    new_versions = {v["name"]: v for v in new_crd["spec"]["versions"]}
    found: list[str] = []
    for v in old_crd["spec"]["versions"]:
        if not v.get("served"):
            continue
        new = new_versions.get(v["name"])
        if new is None or not new.get("served"):
            found.append(f"{v['name']}: no longer served")
            continue
        old_schema = v["schema"]["openAPIV3Schema"]
        found += [
            f"{v['name']} {f}" for f in narrowings(old_schema, new["schema"]["openAPIV3Schema"])
        ]
    return found


# ---- the previous release, from git


# Every release's tag and the commit it names: a clone that carries no tags (CI's fresh clone of
# main) finds the release here, and a tag that names another commit is a mistake to catch.
RELEASES = {"v0.1.0": "5434a079cca4380b1666b57d4ae4beb757617384"}


def previous_tag() -> str:
    """The newest release (`vX.Y.Z`), as a git revision this checkout has: the commit its tag
    names, which a clone without tags has too."""
    newest = max(RELEASES, key=lambda t: tuple(int(p) for p in t.lstrip("v").split(".")))
    commit = RELEASES[newest]
    tagged = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{newest}^{{commit}}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    assert tagged in ("", commit), f"tag {newest} names {tagged}, RELEASES says {commit}"
    return newest


def git_show(tag: str, path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{RELEASES[tag]}:{path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def previous_chart(tag: str, into: Path) -> Path:
    """The chart as the tag has it, unpacked under `into`."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", RELEASES[tag], "charts/lora-operator"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "charts" / "lora-operator"


# ---- the check itself, tested


BASE: Schema = {
    "type": "object",
    "required": ["a"],
    "properties": {
        "a": {"type": "string", "maxLength": 10, "pattern": "^x"},
        "n": {"type": "integer", "minimum": 1, "maximum": 5},
        "e": {"type": "string", "enum": ["A", "B"]},
        "l": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
}


def _changed(path: str, value: Any) -> Schema:
    schema = copy.deepcopy(BASE)
    *parents, last = path.split("/")
    node = schema
    for p in parents:
        node = node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return schema


@pytest.mark.parametrize(
    ("path", "value", "finding"),
    [
        ("properties/a/maxLength", 5, "maxLength 10 -> 5"),
        ("properties/a/pattern", "^y", "pattern"),
        ("properties/n/minimum", 2, "minimum 1 -> 2"),
        ("properties/n/maximum", 4, "maximum 5 -> 4"),
        ("properties/n/type", "string", "type integer -> string"),
        ("properties/e/enum", ["A"], "enum"),
        ("properties/l/maxItems", 2, "maxItems 3 -> 2"),
        ("properties/n", None, ".n: removed"),
        ("required", ["a", "n"], "newly required ['n']"),
        ("additionalProperties", False, "additionalProperties refused"),
        ("x-kubernetes-validations", [{"rule": "self.n > 2"}], "new validation rule"),
        (
            "properties/a/x-kubernetes-validations",
            [{"rule": "!self.startsWith('x') || size(self) > 3"}],
            "new validation rule",
        ),
        ("properties/a/oneOf", [{}], "keywords the check does not know"),
    ],
    ids=lambda v: v if isinstance(v, str) and "/" in v else None,
)
def test_the_check_finds_each_narrowing(path: str, value: Any, finding: str) -> None:
    found = narrowings(BASE, _changed(path, value))
    assert any(finding in f for f in found), found


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("properties/a/maxLength", 20),
        ("properties/a/pattern", None),
        ("properties/n/minimum", 0),
        ("properties/n/maximum", None),
        ("properties/e/enum", ["A", "B", "C"]),
        ("properties/new", {"type": "string", "minLength": 3}),
        ("required", []),
        ("properties/a/description", "documented"),
    ],
    ids=lambda v: v if isinstance(v, str) and "/" in v else None,
)
def test_widening_and_optional_fields_pass(path: str, value: Any) -> None:
    assert narrowings(BASE, _changed(path, value)) == []


def test_a_rule_that_widens_or_covers_only_values_refused_before_passes() -> None:
    """A new scheme: its prefix added to the rule of prefixes, and a rule of its own for values
    with that prefix, which the old rule refused."""
    schemes = "self.startsWith('hf://') || self.startsWith('/')"
    old: Schema = {"type": "string", "x-kubernetes-validations": [{"rule": schemes}]}
    widened = schemes + " || self.startsWith('oci://')"

    def with_rules(*rules: str) -> Schema:
        return {**old, "x-kubernetes-validations": [{"rule": r} for r in rules]}

    own_scheme = "!self.startsWith('oci://') || self.matches('^oci://[a-z]+/')"
    assert narrowings(old, with_rules(widened, own_scheme)) == []
    # A rule for a prefix the old rule accepted narrows it.
    accepted_before = "!self.startsWith('hf://x') || size(self) > 9"
    assert narrowings(old, with_rules(widened, accepted_before)) != []


# The one kind of narrowing the upgrade policy allows (docs/tasks/upgrade.md): a field that
# names a Kubernetes object given the pattern of such a name (a DNS-1123 subdomain). It refuses
# only values that never named an object (a path once did worse: it read another namespace's
# Secret), and the API server's validation ratcheting keeps a stored object that holds one
# updatable while the field is unchanged.
OBJECT_NAME = "^[a-z0-9]+(-+[a-z0-9]+)*(\\.[a-z0-9]+(-+[a-z0-9]+)*)*$"
NAMING_FIELDS = (".spec.source.secretRef.name", ".spec.compose[].name")


def allowed_narrowing(finding: str) -> bool:
    """Whether `finding` is a field naming an object given the object-name pattern (pure)."""
    return any(
        finding.endswith(f" {field}: pattern None -> {OBJECT_NAME!r}") for field in NAMING_FIELDS
    )


def test_every_object_the_previous_crd_accepted_is_valid_under_this_one() -> None:
    tag = previous_tag()
    old = yaml.safe_load(git_show(tag, CRD))
    new = yaml.safe_load((ROOT / CRD).read_text())
    found = crd_narrowings(old, new)
    assert [f for f in found if not allowed_narrowing(f)] == [], (
        f"the CRD narrows what {tag} accepted"
    )


def test_only_object_names_may_narrow_and_only_to_the_name_pattern() -> None:
    assert allowed_narrowing(
        f"v1alpha1 .spec.source.secretRef.name: pattern None -> {OBJECT_NAME!r}"
    )
    assert not allowed_narrowing(f"v1alpha1 .spec.source.uri: pattern None -> {OBJECT_NAME!r}")
    assert not allowed_narrowing("v1alpha1 .spec.source.secretRef.name: pattern None -> '^a$'")
    assert not allowed_narrowing("v1alpha1 .spec.source.secretRef.name: maxLength 253 -> 63")
    names = re.compile(OBJECT_NAME)
    for name in ("hub-creds", "a.b-c", "x"):
        assert names.fullmatch(name)
    for name in ("../../team-b/secrets/hub-creds", "A", "-a", "a.", "a b"):
        assert not names.fullmatch(name)


def test_the_chart_names_a_version_no_older_than_the_last_release() -> None:
    tag = previous_tag()
    chart = yaml.safe_load((ROOT / "charts" / "lora-operator" / "Chart.yaml").read_text())
    version = tuple(int(p) for p in chart["version"].split("-")[0].split("."))
    released = tuple(int(p) for p in tag.lstrip("v").split("."))
    assert version >= released
    assert chart["appVersion"] == chart["version"], "the chart and the images share one version"


# ---- on the cluster: helm upgrade under traffic

N = 2


class Traffic:
    """Generation requests through the inference Service, one after another on each of
    `workers` threads, alternating adapters, until stopped; every answer counted."""

    def __init__(self, h: Harness, ns: str, models: list[str], workers: int = 2) -> None:
        self.h, self.ns, self.models = h, ns, models
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)
        ]

    def _run(self, worker: int) -> None:
        i = worker
        while not self._stop.is_set():
            model = self.models[i % len(self.models)]
            i += 1
            try:
                release.generate(self.h, self.ns, release.service_target(), model)
            except Exception as e:  # every failure is counted, with its text
                with self._lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {model}: {e}"[:500])
            else:
                with self._lock:
                    self.ok += 1

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


class ReadyWatch:
    """Polls the adapters' phases until stopped; records every phase other than Ready."""

    def __init__(self, h: Harness, ns: str, names: list[str]) -> None:
        self.h, self.ns, self.names = h, ns, names
        self.left: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for name in self.names:
                status = release.adapter_status(self.h, self.ns, name)
                phase = status.get("phase")
                if phase != "Ready":
                    ready: dict[str, Any] = next(
                        (c for c in status.get("conditions", []) if c.get("type") == "Ready"), {}
                    )
                    self.left.append(
                        f"{time.strftime('%H:%M:%S')} {name}: {phase} "
                        f"({ready.get('reason')}: {ready.get('message')})"
                    )

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.fixture
def upgrade_release(
    devcluster: Harness, devcluster_namespace: str, tmp_path: Path
) -> Iterator[tuple[Harness, str, Path]]:
    # The local cluster by name (not the e2e fixture, which asks for it at run time): the
    # session's cluster then stays up until this test has run.
    h, ns = devcluster, devcluster_namespace
    try:
        yield h, ns, tmp_path
    finally:
        h.run(["helm", "uninstall", RELEASE, "-n", ns, "--ignore-not-found"], check=False)


def test_helm_upgrade_from_the_last_release_under_traffic(
    upgrade_release: tuple[Harness, str, Path], phase: Phase
) -> None:
    h, ns, work = upgrade_release
    tag = previous_tag()
    old_chart = previous_chart(tag, work / "previous")
    values = manifests.local_values(ns, replicas=N)
    values_file = work / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    # The previous chart tags the images with its own appVersion; the node has this tree's.
    this_version = str(yaml.safe_load((release.CHART / "Chart.yaml").read_text())["appVersion"])
    old_values = copy.deepcopy(values)
    for role in ("operator", "inference"):
        old_values[role]["image"]["tag"] = this_version
    old_values_file = work / "values-previous.yaml"
    old_values_file.write_text(yaml.safe_dump(old_values))
    folder = f"{ns}/sources"
    sources = (AdapterSource("a", seed=1, folder=folder), AdapterSource("b", seed=2, folder=folder))
    names = ["pixel-art", "palette-swap"]

    phase(f"install the chart of {tag}, two adapters Ready on {N} pods")
    release.prepare_model(h, ns)
    release.install_crd(h)
    h.run(["helm", "install", RELEASE, str(old_chart), "-n", ns, "-f", str(old_values_file)])
    release.prepare_adapters(h, ns, sources, "prepare-sources")
    release.ready_inference_pods(h, ns, N)
    for name, source in zip(names, sources, strict=True):
        h.apply({**manifests.adapter(source), "metadata": {"name": name}}, ns)
    for name in names:
        release.wait_adapter_ready(h, ns, name, f"{N}/{N}")
    secret = f"/api/v1/namespaces/{ns}/secrets/{manifests.RELEASE}-admin-token"
    token = base64.b64decode(h.get(secret)["data"]["token"])
    before = {p["metadata"]["name"] for p in h.pods(ns, "lora.dev/inference=true")}

    phase(f"helm upgrade {tag} -> this tree, with generation traffic")
    with ReadyWatch(h, ns, names) as watch, Traffic(h, ns, names) as traffic:
        time.sleep(3)  # traffic before the upgrade too
        started = traffic.ok
        # Every pod is replaced (a new pod annotation), so the upgrade rolls the operator, the
        # router and the inference pods under traffic, whatever the charts' differences.
        bump = ["--set-string", "inference.podAnnotations.lora\\.dev/upgraded=yes"]
        bump += ["--set-string", "operator.podAnnotations.lora\\.dev/upgraded=yes"]
        bump += ["--set-string", "router.podAnnotations.lora\\.dev/upgraded=yes"]
        # The previous release ran its inference pods as the namespace's default account:
        # accepted for the pods of its workloads while the upgrade replaces them (upgrade.md).
        bump += ["--set-json", 'operator.inferencePods.legacyServiceAccounts=["default"]']
        h.run(
            ["helm", "upgrade", RELEASE, str(release.CHART), "-n", ns, "-f", str(values_file),
             *bump, "--wait", "--timeout", "10m"]
        )  # fmt: skip
        release.ready_inference_pods(h, ns, N)
        time.sleep(3)
    assert started > 0, "traffic reached the pods before the upgrade"
    assert traffic.failures == [], f"{len(traffic.failures)} failed, {traffic.ok} answered"
    assert traffic.ok > started

    assert watch.left == [], f"{len(watch.left)} polls saw an adapter leave Ready"

    phase("after the upgrade: new pods, the same token, adapters Ready")

    def replaced() -> bool | None:
        after = {p["metadata"]["name"] for p in h.pods(ns, "lora.dev/inference=true")}
        return before.isdisjoint(after) or None

    h.wait_for("every inference pod of the previous release to be gone", replaced, timeout=120)
    kept = h.get(secret)
    assert base64.b64decode(kept["data"]["token"]) == token
    for name in names:
        assert release.adapter_status(h, ns, name)["phase"] == "Ready"
