"""The docs: references generated from their sources (hack/gen-docs.py) and links that resolve.

The generated files must equal what the generator writes now: a changed CRD field, chart value
or metric without `make docs` fails here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import ROOT

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
