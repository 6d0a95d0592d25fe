"""`make release` (hack/release.py) on a real git repository of the test's own: it tags only a
release whose version moved with the CRD, the values or the pod API, and whose changelog has
its section; it never pushes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

SCRIPT = ROOT / "hack" / "release.py"
CHANGELOG = "# Changelog\n\n## [Unreleased]\n\n## [{v}] - 2026-12-06\n\n### Added\n\n- x\n"


def _git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    return subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True
    ).stdout


def _write(repo: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _chart(version: str, app_version: str | None = None) -> str:
    return f'apiVersion: v2\nname: c\nversion: {version}\nappVersion: "{app_version or version}"\n'


def _commit(repo: Path, files: dict[str, str]) -> None:
    _write(repo, files)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "change")


def _release(repo: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=repo, env=env, capture_output=True, text=True
    )


@pytest.fixture
def released(tmp_path: Path) -> Path:
    """A repository whose HEAD is release v0.1.0 (tagged), with a CRD, values and a pod API."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _commit(
        repo,
        {
            "charts/lora-operator/Chart.yaml": _chart("0.1.0"),
            "charts/lora-operator/values.yaml": "a: 1\n",
            "charts/lora-operator/crds-src/crd.yaml": "kind: CustomResourceDefinition\n",
            "crds/crd.yaml": "kind: CustomResourceDefinition\n",
            "podapi/lora_podapi/cards.py": "X = 1\n",
            "docs/readme.md": "docs\n",
            "CHANGELOG.md": CHANGELOG.format(v="0.1.0"),
        },
    )
    _git(repo, "tag", "-a", "v0.1.0", "-m", "0.1.0")
    return repo


def _tags(repo: Path) -> list[str]:
    return _git(repo, "tag", "--list").split()


@pytest.mark.parametrize(
    "path",
    [
        "crds/crd.yaml",
        "charts/lora-operator/crds-src/crd.yaml",
        "charts/lora-operator/values.yaml",
        "podapi/lora_podapi/cards.py",
    ],
    ids=["crd", "crd-copy", "values", "podapi"],
)
def test_a_contract_change_without_a_version_bump_is_refused(released: Path, path: str) -> None:
    _commit(released, {path: "changed\n"})
    proc = _release(released)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{path} changed since v0.1.0" in proc.stderr
    assert "version is still 0.1.0: bump it" in proc.stderr
    assert _tags(released) == ["v0.1.0"]


def test_a_bump_without_a_changelog_section_is_refused(released: Path) -> None:
    _commit(
        released, {"crds/crd.yaml": "changed\n", "charts/lora-operator/Chart.yaml": _chart("0.2.0")}
    )
    proc = _release(released)
    assert proc.returncode == 1
    assert "CHANGELOG.md has no section `## [0.2.0]`" in proc.stderr
    assert _tags(released) == ["v0.1.0"]


def test_a_bump_with_its_changelog_is_tagged_on_head_and_not_pushed(released: Path) -> None:
    _commit(
        released,
        {
            "crds/crd.yaml": "changed\n",
            "charts/lora-operator/Chart.yaml": _chart("0.2.0"),
            "CHANGELOG.md": CHANGELOG.format(v="0.2.0"),
        },
    )
    remote = released.parent / "remote.git"
    _git(released.parent, "init", "-q", "--bare", str(remote))
    _git(released, "remote", "add", "origin", str(remote))
    proc = _release(released)
    assert proc.returncode == 0, proc.stderr
    assert "git push origin v0.2.0" in proc.stdout
    assert sorted(_tags(released)) == ["v0.1.0", "v0.2.0"]
    assert _git(released, "cat-file", "-t", "v0.2.0").strip() == "tag"  # annotated
    head = _git(released, "rev-parse", "HEAD").strip()
    assert _git(released, "rev-parse", "v0.2.0^{commit}").strip() == head
    assert _git(remote, "tag", "--list") == ""  # nothing pushed


def test_other_changes_need_no_bump_but_the_tag_must_be_new(released: Path) -> None:
    # Docs alone: nothing a cluster depends on changed, but v0.1.0 exists.
    _commit(released, {"docs/readme.md": "more docs\n"})
    proc = _release(released)
    assert proc.returncode == 1
    assert "tag v0.1.0 exists" in proc.stderr
    # A patch release of the same contracts is fine.
    _commit(
        released,
        {
            "charts/lora-operator/Chart.yaml": _chart("0.1.1"),
            "CHANGELOG.md": CHANGELOG.format(v="0.1.1"),
        },
    )
    assert _release(released).returncode == 0
    assert "v0.1.1" in _tags(released)


def test_the_first_release_needs_only_its_changelog(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _commit(repo, {"charts/lora-operator/Chart.yaml": _chart("0.1.0"), "CHANGELOG.md": "# C\n"})
    proc = _release(repo)
    assert proc.returncode == 1
    assert "no section `## [0.1.0]`" in proc.stderr
    _commit(repo, {"CHANGELOG.md": CHANGELOG.format(v="0.1.0")})
    assert _release(repo).returncode == 0
    assert _tags(repo) == ["v0.1.0"]


def test_version_and_app_version_must_agree(released: Path) -> None:
    _commit(
        released,
        {
            "charts/lora-operator/Chart.yaml": _chart("0.2.0", "0.1.0"),
            "CHANGELOG.md": CHANGELOG.format(v="0.2.0"),
        },
    )
    proc = _release(released)
    assert proc.returncode == 1
    assert "version 0.2.0 and appVersion 0.1.0 differ" in proc.stderr


def test_uncommitted_files_are_not_what_is_released(released: Path) -> None:
    """The version and changelog are read from HEAD: a bump left in the working tree does not
    release the commit before it."""
    _commit(released, {"crds/crd.yaml": "changed\n"})
    _write(
        released,
        {
            "charts/lora-operator/Chart.yaml": _chart("0.2.0"),
            "CHANGELOG.md": CHANGELOG.format(v="0.2.0"),
        },
    )
    proc = _release(released)
    assert proc.returncode == 1
    assert "version is still 0.1.0" in proc.stderr


def test_this_repositorys_changelog_has_the_charts_version() -> None:
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("release", SCRIPT)
    assert spec is not None and spec.loader is not None
    release = module_from_spec(spec)
    sys.modules["release"] = release  # its dataclass looks its module up
    try:
        spec.loader.exec_module(release)
    finally:
        del sys.modules["release"]
    chart = (ROOT / "charts" / "lora-operator" / "Chart.yaml").read_text()
    version = release.chart_field(chart, "version")
    assert release.chart_field(chart, "appVersion") == version
    assert release.has_section((ROOT / "CHANGELOG.md").read_text(), version)
