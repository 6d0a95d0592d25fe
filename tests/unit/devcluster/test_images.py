"""The image plan, without building anything: which files each image's key covers, when a key
changes, .dockerignore as Docker reads it, the build order, and the checks that run before any
tool does."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from lora_devcluster import images
from lora_devcluster.images import catalog

from tests.support import ROOT


@pytest.fixture(scope="module")
def tree() -> images.Tree:
    return images.load_tree(ROOT)


def keys(tree: images.Tree, **build_args: str) -> dict[str, str]:
    return {name: spec.key for name, spec in images.plan_images(tree, build_args).items()}


def with_file(tree: images.Tree, path: str, digest: str = "changed:-") -> images.Tree:
    return dataclasses.replace(tree, files={**tree.files, path: digest})


def with_text(tree: images.Tree, path: str, text: str) -> images.Tree:
    # A text the plan parses is also a file whose digest a key may cover.
    changed = with_file(tree, path, f"sha-of-{hash(text)}:-")
    return dataclasses.replace(changed, texts={**tree.texts, path: text})


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {name for name in before if before[name] != after[name]}


# ---- keys


def test_keys_are_stable_for_an_unchanged_tree(tree: images.Tree) -> None:
    assert keys(tree) == keys(images.load_tree(ROOT))
    assert set(keys(tree)) == set(images.NODE_IMAGES)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        # The volume contract, the pod API and the runtime are in both images; each side's own
        # code only in its own.
        ("volume/lora_volume/layout.py", {"operator", "inference"}),
        ("runtime/lora_runtime/kube.py", {"operator", "inference"}),
        ("podapi/lora_podapi/models.py", {"operator", "inference"}),
        ("inference/lora_inference/cli.py", {"inference"}),
        ("operator/lora_operator/__init__.py", {"operator"}),
        ("router/lora_router/routing.py", {"operator"}),
        ("devcluster/lora_devcluster/images/plan.py", set()),  # a development tool, not in images
        ("pyproject.toml", {"operator", "inference"}),
        ("README.md", {"operator", "inference"}),
        ("hack/pause/pause.c", {"pause"}),
        ("docker/operator.Dockerfile", {"operator"}),
        ("docker/inference.Dockerfile", {"inference"}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_changed_input_changes_exactly_the_keys_that_read_it(
    tree: images.Tree, path: str, expected: set[str]
) -> None:
    assert path in tree.files
    assert changed(keys(tree), keys(with_file(tree, path))) == expected


@pytest.mark.parametrize(
    "path",
    [
        "tests/unit/devcluster/test_images.py",
        "docs/chart.md",
        "charts/lora-operator/values.yaml",
        "Makefile",
        "hack/e2e-kind.sh",
        # Ignored by .dockerignore though under a copied directory.
        "inference/lora_inference/__pycache__/cli.cpython-311.pyc",
        "operator/lora_operator.egg-info/PKG-INFO",
    ],
)
def test_an_unrelated_or_ignored_file_changes_no_key(tree: images.Tree, path: str) -> None:
    assert changed(keys(tree), keys(with_file(tree, path))) == set()


def test_a_new_file_under_a_copied_directory_changes_the_keys(tree: images.Tree) -> None:
    after = with_file(tree, "volume/lora_volume/new_module.py", "abc:-")
    assert changed(keys(tree), keys(after)) == {"operator", "inference"}
    after = with_file(tree, "inference/lora_inference/new_module.py", "abc:-")
    assert changed(keys(tree), keys(after)) == {"inference"}


def test_the_executable_bit_is_an_input(tree: images.Tree) -> None:
    path = "volume/lora_volume/files.py"
    digest = tree.files[path]
    flipped = digest[:-1] + ("-" if digest.endswith("x") else "x")
    assert changed(keys(tree), keys(with_file(tree, path, flipped))) == {"operator", "inference"}


def test_a_build_arg_changes_only_the_images_that_declare_it(tree: images.Tree) -> None:
    index = "https://download.pytorch.org/whl/cu128"
    assert changed(keys(tree), keys(tree, TORCH_INDEX_URL=index)) == {"inference"}
    assert changed(keys(tree), keys(tree, NOT_DECLARED="1")) == set()


def test_the_app_version_is_in_the_refs_and_keys(tree: images.Tree) -> None:
    chart = tree.texts["charts/lora-operator/Chart.yaml"]
    bumped = with_text(
        tree,
        "charts/lora-operator/Chart.yaml",
        chart.replace(f'appVersion: "{images.app_version(chart)}"', 'appVersion: "9.9.9"'),
    )
    specs = images.plan_images(bumped)
    assert specs["operator"].ref == "lora-operator/operator:9.9.9"
    assert specs["inference"].ref == "lora-operator/inference:9.9.9"
    assert changed(keys(tree), keys(bumped)) == {"operator", "inference"}


def test_the_base_key_is_in_the_images_built_on_it(
    tree: images.Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = keys(tree)
    monkeypatch.setattr(catalog, "BASE_PACKAGES", (*catalog.BASE_PACKAGES, "curl"))
    assert changed(before, keys(tree)) == {"base", "operator", "inference"}


def test_the_dockerfile_images_build_from_the_local_base(tree: images.Tree) -> None:
    specs = images.plan_images(tree)
    base = specs["base"].ref
    assert base.startswith("localhost/lora-devcluster/base:")
    for name in ("operator", "inference"):
        assert dict(specs[name].build_args)["BASE_IMAGE"] == base
    assert specs["pause"].ref == "localhost/lora-devcluster/pause:3.10"


def test_base_image_cannot_be_overridden(tree: images.Tree) -> None:
    with pytest.raises(images.ImageError, match="BASE_IMAGE"):
        images.plan_images(tree, {"BASE_IMAGE": "python:3.11-slim"})


def test_the_context_is_the_copied_sources_minus_the_dockerignore(tree: images.Tree) -> None:
    context = images.plan_images(tree)["operator"].context
    assert "pyproject.toml" in context and "README.md" in context
    assert "volume/lora_volume/files.py" in context
    assert "operator/lora_operator/__main__.py" in context
    assert "router/lora_router/__main__.py" in context
    # The operator image holds no inference server (and so no reason to install torch).
    assert not [f for f in context if f.startswith(("devcluster/", "inference/"))]
    assert not [f for f in context if f.startswith(("tests/", "docs/", "charts/", ".venv"))]
    assert not [f for f in context if "__pycache__" in f or f.endswith(".pyc")]


# ---- Dockerfile and .dockerignore parsing


def test_copy_sources_skip_stages_and_read_flags_and_json() -> None:
    text = (
        "FROM x AS build\n"
        "# COPY commented/ out/\n"
        "COPY a.txt b/ /dst/\n"
        "COPY --chown=1:1 --chmod=0644 c.txt /dst/\n"
        'COPY ["d e.txt", "/dst/"]\n'
        "ADD \\\n    f/ /f/\n"
        "FROM y\n"
        "COPY --from=build /opt/venv /opt/venv\n"
    )
    assert images.copy_sources(text) == ["a.txt", "b", "c.txt", "d e.txt", "f"]


def test_remote_sources_cannot_be_keyed() -> None:
    with pytest.raises(images.ImageError, match="remote"):
        images.copy_sources("ADD https://example.com/x.tar /x\n")


def test_declared_args_and_the_pip_extra() -> None:
    text = (ROOT / "docker" / "inference.Dockerfile").read_text()
    assert images.declared_args(text) == {"BASE_IMAGE", "TORCH_INDEX_URL"}
    assert images.pip_extra(text) == "inference"
    assert images.pip_extra((ROOT / "docker" / "operator.Dockerfile").read_text()) == "operator"


IGNORE = """
# comment
.git
**/__pycache__
*.egg-info
bench
docs/*.md
!docs/keep.md
/rooted
a?c
[xy]z
"""


@pytest.mark.parametrize(
    ("path", "ignored"),
    [
        (".git/config", True),
        ("src/pkg/__pycache__/m.pyc", True),
        ("__pycache__/m.pyc", True),
        ("x.egg-info/PKG-INFO", True),
        ("src/x.egg-info/PKG-INFO", False),  # `*` does not cross a /
        ("bench", True),
        ("bench/run.py", True),
        ("src/bench/run.py", False),  # patterns are rooted at the context
        ("docs/a.md", True),
        ("docs/keep.md", False),  # a later ! pattern re-includes
        ("docs/sub/a.md", False),
        ("rooted/f", True),
        ("abc", True),
        ("abbc", False),
        ("xz", True),
        ("zz", False),
        ("src/main.py", False),
    ],
)
def test_dockerignore_matches_as_docker_does(path: str, ignored: bool) -> None:
    assert images.is_ignored(path, images.parse_dockerignore(IGNORE)) is ignored


def test_select_context_takes_files_and_directories() -> None:
    files = ["a.txt", "b/x.py", "b/__pycache__/x.pyc", "bb/y.py", "c/z.py"]
    patterns = images.parse_dockerignore("**/__pycache__\n")
    assert images.select_context(files, ["a.txt", "b"], patterns) == ("a.txt", "b/x.py")
    assert images.select_context(files, ["*.txt"], patterns) == ("a.txt",)
    assert images.select_context(files, [""], patterns) == (
        "a.txt",
        "b/x.py",
        "bb/y.py",
        "c/z.py",
    )


def test_app_version_reads_the_chart() -> None:
    assert images.app_version('name: x\nappVersion: "1.2.3"\n') == "1.2.3"
    assert images.app_version("appVersion: 1.2.3\n") == "1.2.3"
    with pytest.raises(images.ImageError, match="appVersion"):
        images.app_version("version: 1\n")


def test_prefetch_takes_the_extra_and_the_build_backend() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    (step,) = images.plan_prefetch(pyproject, "operator", {})
    assert "kopf==1.45.2" in step.requirements
    assert any(r.startswith("setuptools") for r in step.requirements)
    assert not any(r.startswith("torch") for r in step.requirements)
    first, _ = images.plan_prefetch(pyproject, "inference", {"TORCH_INDEX_URL": "https://x/"})
    assert first == images.PipDownload(("torch==2.13.0",), index_url="https://x/", no_deps=True)


# ---- the build order


@pytest.mark.parametrize(
    ("wanted", "archived", "expected"),
    [
        (images.NODE_IMAGES, images.NODE_IMAGES, []),
        (images.NODE_IMAGES, (), ["base", "pause", "operator", "inference"]),
        (("operator",), ("base",), ["operator"]),
        (("operator",), (), ["base", "operator"]),  # the base is needed to build it
        (("pause",), (), ["pause"]),  # pause needs no base
        (("inference", "operator"), ("base", "operator"), ["inference"]),
    ],
    ids=["all-cached", "cold", "base-cached", "base-missing", "pause-alone", "one-missing"],
)
def test_plan_builds(
    tree: images.Tree, wanted: tuple[str, ...], archived: tuple[str, ...], expected: list[str]
) -> None:
    assert images.plan_builds(images.plan_images(tree), wanted, archived) == expected


def test_plan_builds_refuses_unknown_images(tree: images.Tree) -> None:
    with pytest.raises(images.ImageError, match="unknown image"):
        images.plan_builds(images.plan_images(tree), ["curl"], [])


# ---- reading the checkout, and the contract without a build


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_load_tree_lists_tracked_and_untracked_files_but_not_gitignored(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("*.log\n")
    (repo / "tracked.py").write_text("a\n")
    _git(repo, "add", ".")
    (repo / "untracked.py").write_text("b\n")
    (repo / "noise.log").write_text("c\n")
    tree = images.load_tree(repo)
    assert {"tracked.py", "untracked.py", ".gitignore"} <= set(tree.files)
    assert "noise.log" not in tree.files


def test_built_names_the_missing_image_and_the_command(tmp_path: Path) -> None:
    with pytest.raises(images.MissingImage) as e:
        images.built(cache_dir=tmp_path)
    assert "base" in str(e.value) and "make images" in str(e.value)


def test_built_returns_the_records_when_the_archives_exist(tmp_path: Path) -> None:
    specs = images.plan_images(images.load_tree(ROOT))
    for spec in specs.values():
        (tmp_path / spec.archive_name()).write_bytes(b"")
    records = images.built(cache_dir=tmp_path)
    assert [r.role for r in records] == list(images.NODE_IMAGES)
    operator = records[2].as_dict()
    assert operator["ref"].startswith("lora-operator/operator:")
    assert operator["archive"] == str(tmp_path / specs["operator"].archive_name())
    assert operator["key"] == specs["operator"].key


def test_building_as_non_root_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(images.ImageError, match="needs root"):
        images.check_tools(["buildah"])


def test_a_missing_tool_names_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(images.ImageError, match=r"make install.*debootstrap"):
        images.check_tools(["debootstrap"])


# ---- pushing


@pytest.mark.parametrize(
    ("registry", "expected"),
    [
        ("registry.example.com/lora-operator", "registry.example.com/lora-operator/operator:0.1.0"),
        ("localhost:5000", "localhost:5000/operator:0.1.0"),
        ("docker://r.io/a/b/", "r.io/a/b/operator:0.1.0"),
    ],
)
def test_push_destination_keeps_the_name_and_tag_under_the_registry(
    registry: str, expected: str
) -> None:
    assert images.push_destination("lora-operator/operator:0.1.0", registry) == expected


@pytest.mark.parametrize("registry", ["", "https://r.io/x", "/abs/path", "r.io/a b"])
def test_push_refuses_what_is_not_a_registry(registry: str) -> None:
    with pytest.raises(images.ImageError, match="expected host"):
        images.push_destination("lora-operator/operator:0.1.0", registry)


def test_only_operator_and_inference_are_pushed() -> None:
    parser = images.build_parser()
    args = parser.parse_args(["push", "r.io/x", "--only", "operator", "--plain-http"])
    assert (args.registry, args.only, args.plain_http) == ("r.io/x", ["operator"], True)
    with pytest.raises(SystemExit):
        parser.parse_args(["push", "r.io/x", "--only", "pause"])
    base = images.Image("localhost/lora-devcluster/base:k", Path("/nonexistent.tar"), "k", "base")
    with pytest.raises(images.ImageError, match="only operator, inference"):
        images.tag_local([base])


def test_the_id_file_sits_beside_the_archive(tree: images.Tree) -> None:
    spec = images.plan_images(tree)["operator"]
    assert spec.id_name() == spec.archive_name().removesuffix(".tar") + ".id"
