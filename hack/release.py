"""`make release`: tag the commit checked out as release `v<version>` of charts/lora-operator's
Chart.yaml, after checking that the release is one.

It refuses when the CRD (crds/, charts/lora-operator/crds-src/), the chart's values.yaml or the
pod API (podapi/) changed since the last tag `v*` while Chart.yaml's version did not move, when
version and appVersion differ, when CHANGELOG.md has no section for the version, or when the
tag exists. Otherwise it creates the annotated tag `v<version>` on HEAD. It never pushes (`git
push origin v<version>` is yours to run), and it reads Chart.yaml and CHANGELOG.md as HEAD has
them, so the tag names what was committed.

Standard library only: it runs before any virtualenv exists.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

CHART = "charts/lora-operator/Chart.yaml"
CHANGELOG = "CHANGELOG.md"
# What a user's cluster or client depends on: a change here is a release of its own.
WATCHED = ("crds", "charts/lora-operator/crds-src", "charts/lora-operator/values.yaml", "podapi")


class Refused(Exception):
    """The release is refused; the message says what to change."""


@dataclass(frozen=True)
class Facts:
    """What the decision reads: the chart's version and appVersion at HEAD, the last `v*` tag
    reachable from HEAD (None when there is none), the watched paths changed since it, the
    changelog at HEAD and the tags that exist."""

    version: str
    app_version: str
    last_tag: str | None
    changed: tuple[str, ...]
    changelog: str
    tags: frozenset[str]


def chart_field(chart_yaml: str, key: str) -> str:
    """A top-level scalar of Chart.yaml, quoted or not, read as the Makefile reads it (pure)."""
    m = re.search(rf'^{key}: *"?([^"\n]*?)"?\s*$', chart_yaml, re.MULTILINE)
    if not m or not m.group(1):
        raise Refused(f"{CHART} has no {key}")
    return m.group(1)


def has_section(changelog: str, version: str) -> bool:
    """Whether the changelog has a Keep a Changelog section `## [<version>]` (pure)."""
    return re.search(rf"^## \[{re.escape(version)}\]", changelog, re.MULTILINE) is not None


def plan_release(facts: Facts) -> str:
    """The tag to create, or Refused saying why not (pure)."""
    tag = f"v{facts.version}"
    if facts.app_version != facts.version:
        raise Refused(
            f"{CHART}: version {facts.version} and appVersion {facts.app_version} differ; "
            "they move together (docs/tasks/upgrade.md)"
        )
    if facts.last_tag is not None and facts.changed and facts.last_tag.lstrip("v") == facts.version:
        raise Refused(
            f"{', '.join(facts.changed)} changed since {facts.last_tag} but {CHART}'s version "
            f"is still {facts.version}: bump it (and appVersion), and say what changed in "
            f"{CHANGELOG}"
        )
    if tag in facts.tags:
        raise Refused(f"tag {tag} exists: bump version and appVersion in {CHART}")
    if not has_section(facts.changelog, facts.version):
        raise Refused(f"{CHANGELOG} has no section `## [{facts.version}]`: write it first")
    return tag


def _git(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise Refused(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout if proc.returncode == 0 else ""


def load_facts() -> Facts:
    """The facts of the repository in the working directory, from git."""
    chart = _git("show", f"HEAD:{CHART}")
    last = _git("describe", "--tags", "--abbrev=0", "--match", "v*", "HEAD", check=False).strip()
    changed: tuple[str, ...] = ()
    if last:
        names = _git("diff", "--name-only", f"{last}..HEAD", "--", *WATCHED)
        changed = tuple(sorted({n for n in names.splitlines() if n}))
    return Facts(
        version=chart_field(chart, "version"),
        app_version=chart_field(chart, "appVersion"),
        last_tag=last or None,
        changed=changed,
        changelog=_git("show", f"HEAD:{CHANGELOG}", check=False),
        tags=frozenset(_git("tag", "--list", "v*").split()),
    )


def main(argv: Sequence[str] = ()) -> int:
    del argv
    try:
        tag = plan_release(load_facts())
        version = tag.removeprefix("v")
        _git("tag", "-a", tag, "-m", f"lora-operator {version} (CHANGELOG.md, [{version}])")
    except Refused as e:
        print(f"make release: refused: {e}", file=sys.stderr)
        return 1
    print(f"tagged HEAD as {tag}; publish it with `git push origin {tag}`")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
