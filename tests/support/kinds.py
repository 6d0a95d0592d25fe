"""The suite's three kinds of tests, told apart by directory, and the rule that keeps them
apart (tests/conftest.py applies both to every collected test).

- `unit` (tests/unit): no cluster and no root; the operator's, the router's and the volume's
  import no torch.
- `cluster` (tests/cluster): the local cluster (the `devcluster` fixtures, root, the built
  binaries and images).
- `e2e` (tests/e2e): the chart, rendered, and installed on the local cluster or another.

Pure: decides from paths and fixture names, so it is tested without running pytest in pytest.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

KINDS = ("unit", "cluster", "e2e")


def kind_of(path: Path, tests_dir: Path) -> str | None:
    """The kind of the test file at `path`: the first folder under `tests_dir`, if it is one."""
    try:
        parts = path.relative_to(tests_dir).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in KINDS else None


def misplaced(tests: Iterable[tuple[str, Path, Iterable[str]]], tests_dir: Path) -> list[str]:
    """What is wrong with the placement of each (node id, file, fixture names) test: outside the
    three kinds' folders, or a unit test that needs the cluster."""
    problems = []
    for nodeid, path, fixtures in tests:
        kind = kind_of(path, tests_dir)
        if kind is None:
            problems.append(
                f"{nodeid}: put it under tests/unit, tests/cluster or tests/e2e "
                "(the folder is its kind and gives its marker)"
            )
        elif kind == "unit" and "devcluster" in fixtures:
            problems.append(
                f"{nodeid} uses the devcluster fixture: move it to tests/cluster "
                "(unit tests run with no cluster and no root)"
            )
    return problems
