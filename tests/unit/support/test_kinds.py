"""The suite's kinds by folder and the placement rule (tests/support/kinds.py), pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import kinds

TESTS = Path("/repo/tests")


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("unit/operator/test_status.py", "unit"),
        ("unit/test_docs.py", "unit"),
        ("cluster/operator/test_crd.py", "cluster"),
        ("e2e/test_chart.py", "e2e"),
        ("test_loose.py", None),
        ("support/test_x.py", None),
        ("unit", None),
    ],
    ids=lambda v: str(v),
)
def test_the_kind_is_the_first_folder(path: str, kind: str | None) -> None:
    assert kinds.kind_of(TESTS / path, TESTS) == kind


def test_outside_the_tests_folder_there_is_no_kind() -> None:
    assert kinds.kind_of(Path("/elsewhere/unit/test_x.py"), TESTS) is None


def test_a_unit_test_on_the_cluster_is_told_to_move() -> None:
    problems = kinds.misplaced(
        [
            ("tests/unit/operator/test_a.py::test_pure", TESTS / "unit/operator/test_a.py", ()),
            (
                "tests/unit/operator/test_a.py::test_on_cluster",
                TESTS / "unit/operator/test_a.py",
                ("crd", "devcluster", "tmp_path"),
            ),
            (
                "tests/cluster/operator/test_b.py::test_on_cluster",
                TESTS / "cluster/operator/test_b.py",
                ("devcluster",),
            ),
            ("tests/e2e/test_c.py::test_on_cluster", TESTS / "e2e/test_c.py", ("devcluster",)),
        ],
        TESTS,
    )
    assert problems == [
        "tests/unit/operator/test_a.py::test_on_cluster uses the devcluster fixture: move it to "
        "tests/cluster (unit tests run with no cluster and no root)"
    ]


def test_a_test_of_no_kind_is_told_where_to_go() -> None:
    (problem,) = kinds.misplaced([("tests/test_x.py::test_y", TESTS / "test_x.py", ())], TESTS)
    assert problem.startswith("tests/test_x.py::test_y: put it under tests/unit, tests/cluster")
