"""The docs: references generated from their sources (hack/gen-docs.py), links and their anchors
that resolve, and the names the prose takes from the code that exist there.

The generated files must equal what the generator writes now: a changed CRD field, chart value
or metric without `make docs` fails here. The hand-written pages are held to the code where a
name can be checked mechanically: the flags given to our programs (against their argument
parsers), the chart values they name (against values.yaml) and the metrics (against the
packages' source)."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support import ROOT
from tests.support.docs import parse_blocks

DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "hack" / "gen-docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _gen()


def test_value_docs_reads_the_comment_above_each_key() -> None:
    text = (
        "# top comment\n"
        "a: 1\n"
        "\n"
        "# the group\n"
        "g:\n"
        "  # first line\n"
        "  # second line\n"
        "  x: 2\n"
        "  y: 3\n"
        "  h:\n"
        "    # deep\n"
        "    z: 4\n"
        "b: 5\n"
    )
    assert gen.value_docs(text) == {
        "a": "top comment",
        "g": "the group",
        "g.x": "first line second line",
        "g.y": "",
        "g.h": "",
        "g.h.z": "deep",
        "b": "",
    }


def test_render_values_lists_every_leaf_once_with_type_and_default() -> None:
    text = "# the name\nname: x\n# a group\ng:\n  # a number\n  n: 3\n  # a list\n  l: []\n"
    schema = {
        "properties": {
            "name": {"type": "string"},
            "g": {
                "properties": {
                    "n": {"type": "integer"},
                    "l": {"type": "array", "items": {"type": "string"}},
                }
            },
        }
    }
    out = gen.render_values(text, schema)
    assert '| `name` | string | `"x"` | the name |' in out
    assert "| `g.n` | integer | `3` | a number |" in out
    assert "| `g.l` | array | `[]` | a list |" in out
    assert out.count("## Top level") == 1 and "## `g`\n\na group" in out


def test_generated_references_match_their_sources(helm: str) -> None:
    # `helm` (tests/support/chart.py): the chart's references are rendered with it; a missing
    # helm fails under CI rather than skipping.
    stale = [
        str(path.relative_to(ROOT))
        for path, text in gen.generate().items()
        if not path.exists() or path.read_text() != text
    ]
    assert stale == [], f"{stale} differ from their sources: run `make docs` and commit them"


def test_the_sizing_table_is_what_hack_sizing_computes() -> None:
    """chart.md's GPU memory table is hack/sizing.py's output (the architectures on torch's
    meta device, the server's own slot layout), run in a process of its own."""
    if importlib.util.find_spec("diffusers") is None:
        pytest.skip("hack/sizing.py needs the inference extra (torch, diffusers)")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "sizing.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.strip()
    assert table.count("\n") >= 4, table
    assert table in (ROOT / "docs" / "chart.md").read_text(), (
        f"docs/chart.md's sizing table differs from hack/sizing.py's:\n{table}"
    )


_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    for target, _anchor in _LINK.findall(doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


_FORBIDDEN = [
    (re.compile(r"\bissue \d+|\bissues? #\d+", re.I), "an issue number"),
    (re.compile(r"pitfall \d+|in the notes\b", re.I), "the development notes"),
    (re.compile(r"\blent\b|this session\b", re.I), "who had which machine"),
]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_the_product_only(doc: Path) -> None:
    text = doc.read_text()
    for pattern, what in _FORBIDDEN:
        found = pattern.search(text)
        assert found is None, f"{doc.name} mentions {what}: {found.group(0)!r}"


# ---- the docs' text outside and inside fenced blocks

_FENCE = re.compile(r"^\s*```")


def _lines_outside_fences(doc: Path) -> list[tuple[int, str]]:
    """The doc's prose lines with their numbers: a `#` or a backtick in a code block is code."""
    lines, fenced = [], False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def _code_lines(doc: Path) -> list[tuple[int, str]]:
    """Each fenced block's lines with their numbers, a `\\` continuation joined to its line."""
    lines = []
    for block in parse_blocks(doc, doc.read_text()):
        number = block.line + 1
        for line in block.text.replace("\\\n", " \n").splitlines():
            lines.append((number, line))
            number += 1
    return lines


_SPAN = re.compile(r"`([^`\n]+)`")


def _spans(doc: Path) -> list[tuple[int, str]]:
    """The inline code spans of the doc's prose, with their lines' numbers."""
    return [(n, span) for n, line in _lines_outside_fences(doc) for span in _SPAN.findall(line)]


# ---- anchors


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped but for hyphens and
    underscores, spaces turned into hyphens (a link's text stays, its target goes)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    """Every anchor the doc's headings make; a repeated heading gets -1, -2... as on GitHub."""
    seen: dict[str, int] = {}
    for _, line in _lines_outside_fences(doc):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def test_github_slug_keeps_words_hyphens_and_underscores_only() -> None:
    assert github_slug("Failures and retries") == "failures-and-retries"
    assert github_slug("Simulated H200 pods (`bench/bench_fleet.py --simulate`)") == (
        "simulated-h200-pods-benchbench_fleetpy---simulate"
    )
    assert github_slug("Refused, and why") == "refused-and-why"
    assert github_slug("See [the CRD](crd.md)") == "see-the-crd"


_ANCHOR_LINK = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_anchor_links_name_a_heading_of_their_doc(doc: Path) -> None:
    """`file.md#heading` and `#heading`: the heading exists, under GitHub's slug of it."""
    broken = []
    for number, line in _lines_outside_fences(doc):
        for target, anchor in _ANCHOR_LINK.findall(line):
            linked = (doc.parent / target).resolve() if target else doc
            if "://" in target or linked.suffix != ".md" or not linked.exists():
                continue  # another site, a file that is not Markdown, or a broken link (above)
            if anchor not in _anchors(linked):
                broken.append(f"{doc.relative_to(ROOT)}:{number}: {target}#{anchor}")
    assert broken == [], "links to headings that do not exist:\n" + "\n".join(broken)


# ---- our programs' flags

# The argument parsers of the programs the docs run; the flags are taken from their source, so
# neither torch nor kopf is imported.
_PARSERS = [
    "inference/lora_inference/cli.py",
    "inference/lora_inference/tools/demo.py",
    "operator/lora_operator/edges/config.py",
    "operator/lora_operator/admintoken.py",
    "operator/lora_operator/cli.py",
    "router/lora_router/config.py",
    "devcluster/lora_devcluster/cli.py",
    "devcluster/lora_devcluster/images/cli.py",
    "demo/lora_demo/demo.py",
]
_PROGRAMS = {"lora-inference", "lora-router", "lora-devcluster", "lora-operator"}
_MODULES = {"lora_inference", "lora_operator", "lora_operator.admintoken", "lora_router"}
_MODULES |= {"lora_devcluster", "lora_inference.tools.demo", "lora_demo"}


def _defined_flags(source: str) -> set[str]:
    """The `--flags` of every `add_argument` call in `source`, with the `--no-` form of a
    BooleanOptionalAction (pure)."""
    flags: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        names = {
            a.value
            for a in node.args
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value[:2] == "--"
        }
        negated = any(
            k.arg == "action" and getattr(k.value, "attr", "") == "BooleanOptionalAction"
            for k in node.keywords
        )
        flags |= names | ({f"--no-{n[2:]}" for n in names} if negated else set())
    return flags


def our_flags() -> set[str]:
    """Every flag any of our parsers defines, and the `--help` argparse adds to each."""
    return {"--help"}.union(*(_defined_flags((ROOT / p).read_text()) for p in _PARSERS))


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True, posix=True)
    except ValueError:  # an unbalanced quote in prose: the words are still words
        return command.split()


_BEFORE_A_COMMAND = {"--", "sudo", "exec", "env", "nohup", "|", "||", "&&", ";"}


def _runs_a_command_at(words: list[str], i: int) -> bool:
    """Whether `words[i]` is a command's name, not an argument: `helm install lora-inference`
    names a release."""
    before = words[i - 1] if i else ""
    return not i or before in _BEFORE_A_COMMAND or re.fullmatch(r"[A-Z_]+=\S*", before) is not None


def _program_start(words: list[str]) -> int | None:
    """Where one of our programs' arguments start in `words` (after `kubectl exec ... --`, an
    environment variable, sudo...), if one runs."""
    for i, word in enumerate(words):
        if not _runs_a_command_at(words, i):
            continue
        if word.rsplit("/", 1)[-1] in _PROGRAMS:
            return i + 1
        module = words[i + 2] if words[i + 1 : i + 2] == ["-m"] and i + 2 < len(words) else ""
        if word.rsplit("/", 1)[-1].startswith("python") and module in _MODULES:
            return i + 3
    return None


def flags_passed_to_our_programs(command: str) -> list[str]:
    """The `--flags` a shell command passes to one of our programs, up to the next command
    (pure)."""
    words = _words(command)
    start = _program_start(words)
    if start is None:
        return []
    flags = []
    for word in words[start:]:
        if word in ("|", "||", "&&", ";", ">", "<") or word.endswith(";"):
            break
        if re.fullmatch(r"--[a-z0-9][a-z0-9-]*(=.*)?", word):
            flags.append(word.split("=", 1)[0])
    return flags


def test_flags_passed_to_our_programs_stop_at_the_next_command() -> None:
    assert flags_passed_to_our_programs("python -m lora_router --port=8080 | grep --color x") == [
        "--port"
    ]
    assert flags_passed_to_our_programs(
        "kubectl exec deploy/x -- lora-inference serve --model /m --no-compile"
    ) == ["--model", "--no-compile"]
    assert flags_passed_to_our_programs("helm install lora-inference oci://x --version 1") == []
    assert flags_passed_to_our_programs("LORA_X=1 .venv/bin/lora-router --poll") == ["--poll"]


def test_our_flags_include_negated_boolean_flags() -> None:
    source = (
        "p.add_argument('--a', action=argparse.BooleanOptionalAction)\n"
        "p.add_argument('-b', '--bee')\n"
    )
    assert _defined_flags(source) == {"--a", "--no-a", "--bee"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_that_run_our_programs_pass_flags_they_define(doc: Path) -> None:
    """Every command in a code block or an inline span that runs one of our programs (helm's,
    kubectl's or kopf's flags are not checked: only flags after our program's name)."""
    known = our_flags()
    unknown = [
        f"{doc.relative_to(ROOT)}:{number}: {flag}"
        for number, command in [*_code_lines(doc), *_spans(doc)]
        for flag in flags_passed_to_our_programs(command)
        if flag not in known
    ]
    assert unknown == [], "flags no parser of ours defines:\n" + "\n".join(unknown)


# Pages whose bare flags belong to other programs: the benchmarks' scripts (bench/), the dev
# cluster's components (kube-router, tini, kubectl) and the image builds (buildah, pip).
_OTHER_PROGRAMS_PAGES = {"benchmarks.md", "devcluster.md", "images.md"}
# Flags of other tools that the other pages name bare, each with its tool.
_OTHER_TOOLS_FLAGS = {"--set": "helm", "--reuse-values": "helm", "--kube-version": "helm"}


def bare_flags(span: str) -> list[str]:
    """The flags an inline span names alone (`--max-loras N`, `--inference-*`), without a
    program before them (pure)."""
    words = span.split()
    if not words or not re.fullmatch(r"--[a-z0-9][a-z0-9-]*\*?(=\S*)?", words[0]):
        return []
    return [w.split("=", 1)[0] for w in words if re.fullmatch(r"--[a-z0-9][a-z0-9-]*\*?(=\S*)?", w)]


def _is_defined(flag: str, known: set[str]) -> bool:
    if flag.endswith("*"):  # a family of flags: one of them will do
        return any(k.startswith(flag[:-1]) for k in known)
    return flag in known or flag in _OTHER_TOOLS_FLAGS


def test_bare_flags_take_every_flag_of_a_span_and_nothing_else() -> None:
    assert bare_flags("--merge M") == ["--merge"]
    assert bare_flags("--run-firewall=true --run-router=false") == [
        "--run-firewall",
        "--run-router",
    ]
    assert bare_flags("kubectl logs --previous") == []
    assert bare_flags("--train_norm") == []


@pytest.mark.parametrize(
    "doc",
    [d for d in DOCS if d.name not in _OTHER_PROGRAMS_PAGES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_flags_named_alone_are_flags_of_our_programs(doc: Path) -> None:
    """A flag in an inline span of its own (a flags table, `--max-loras` in a sentence) is one
    of our programs' on the pages about them; another tool's flag named alone there is listed
    in _OTHER_TOOLS_FLAGS."""
    known = our_flags()
    unknown = [
        f"{doc.relative_to(ROOT)}:{number}: {flag}"
        for number, span in _spans(doc)
        for flag in bare_flags(span)
        if not _is_defined(flag, known)
    ]
    assert unknown == [], "flags no parser of ours defines:\n" + "\n".join(unknown)


# ---- chart values

# The endpoint picker's chart is another chart: routing.md names its values as they are in the
# file the docs give for it.
_VALUES_FILES = [
    ROOT / "charts" / "lora-operator" / "values.yaml",
    ROOT / "examples" / "routing" / "endpoint-picker-values.yaml",
]


def _has_key(values: Any, path: list[str]) -> bool:
    """Whether `path` is a key of `values`, a leaf or a map; an empty map (`podLabels: {}`)
    takes keys of the user's, so anything below it is one (pure)."""
    for part in path:
        if not isinstance(values, dict) or part not in values:
            return values == {}
        values = values[part]
    return True


def _values_key(span: str, tops: set[str]) -> list[str] | None:
    """The dotted key an inline span starts with (`inference.podLabels.tier: gpu`), when its
    first part is one of the chart's top-level keys."""
    key = re.match(r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)+", span)
    if key is None or key.group(0).split(".")[0] not in tops:
        return None
    return key.group(0).split(".")


def test_has_key_takes_leaves_maps_and_keys_below_an_empty_map() -> None:
    values = {"inference": {"model": "m", "podLabels": {}, "tier": {"gpu": 1}}}
    assert _has_key(values, ["inference", "tier"])
    assert _has_key(values, ["inference", "podLabels", "team"])
    assert not _has_key(values, ["inference", "modle"])
    assert not _has_key(values, ["inference", "model", "name"])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_chart_values_the_docs_name_are_keys_of_the_chart(doc: Path) -> None:
    """`inference.x`, `operator.x`, `router.x`, `adapterVolume.x`... in an inline span: every
    top-level key of the chart's values is checked, down to the leaf the span names."""
    values = [yaml.safe_load(f.read_text()) for f in _VALUES_FILES]
    tops = set(values[0])
    unknown = [
        f"{doc.relative_to(ROOT)}:{number}: {'.'.join(key)}"
        for number, span in _spans(doc)
        if (key := _values_key(span, tops)) is not None
        and not any(_has_key(v, key) for v in values)
    ]
    assert unknown == [], "no such key in the chart's values.yaml:\n" + "\n".join(unknown)


# ---- metrics

_METRIC = re.compile(r"((?:lora_|vllm:)[a-z0-9_:]*[a-z_])(\{[^}]*\})?")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


# The product's packages, where a metric is registered or read; the tools' (bench, demo,
# devcluster) register none the docs may name.
_PRODUCT_PACKAGES = ["operator", "inference", "router", "volume", "runtime", "podapi", "playground"]


def _package_names() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/lora_*/__init__.py")}


def _product_source() -> str:
    return "\n".join(
        f.read_text() for d in _PRODUCT_PACKAGES for f in (ROOT / d).glob("lora_*/**/*.py")
    )


def metric_name(span: str) -> str | None:
    """The Prometheus name an inline span is, labels aside (`lora_router_pods{state="ready"}`);
    a name ending in a digit is a numbered key (`lora_v17`), not a metric (pure)."""
    found = _METRIC.fullmatch(span.strip())
    return found.group(1) if found else None


def _registered(name: str, source: str) -> bool:
    """Whether `name` stands in the source as a word, as registered or with the suffix the
    client adds (a histogram's _bucket/_sum/_count, a counter's _total)."""
    names = {name} | {name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)}
    return any(re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])", source) for n in names)


def test_metric_name_reads_labels_and_skips_modules_and_numbered_keys() -> None:
    assert metric_name('lora_router_pods{state="ready"}') == "lora_router_pods"
    assert metric_name("vllm:num_requests_waiting") == "vllm:num_requests_waiting"
    assert metric_name("lora_router.http1") is None
    assert metric_name("lora_v17") is None
    assert _registered("lora_x_total", 'Counter("lora_x", "help")')
    assert not _registered("lora_x_total", 'Counter("lora_xy", "help")')


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_metrics_the_docs_name_are_in_the_code(doc: Path) -> None:
    """A backticked `lora_...` or `vllm:...` name that is not one of our packages' names is in
    our packages' source as a word (a metric registered, or read from a vLLM server)."""
    packages, source = _package_names(), _product_source()
    unknown = [
        f"{doc.relative_to(ROOT)}:{number}: {name}"
        for number, span in _spans(doc)
        if (name := metric_name(span)) is not None
        and name not in packages
        and not _registered(name, source)
    ]
    assert unknown == [], "metrics no code of ours names:\n" + "\n".join(unknown)
