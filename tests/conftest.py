"""Settings and rules for every test: the kind of a test (unit, cluster, e2e) is the folder it
is in, and becomes its marker (`pytest -m unit`); a unit test that needs the cluster is a
collection error. The `phase` fixture (tests/support/phases.py), the `origin` server
(tests/support/origin.py) and the chart's `helm` and `crds` (tests/support/chart.py) are for
every suite.
Diffusers' and transformers' chatter stays out of test output."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.support import kinds

logging.getLogger("diffusers").setLevel(logging.ERROR)
logging.getLogger("transformers").setLevel(logging.ERROR)

pytest_plugins = ["tests.support.phases", "tests.support.origin", "tests.support.chart"]

TESTS = Path(__file__).resolve().parent


# tryfirst: the markers must be there before `-m` deselects by them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    files = {item.nodeid: Path(item.path).resolve() for item in items}
    problems = kinds.misplaced(
        ((item.nodeid, files[item.nodeid], getattr(item, "fixturenames", ())) for item in items),
        TESTS,
    )
    if problems:
        raise pytest.UsageError("misplaced tests:\n" + "\n".join(problems))
    for item in items:
        kind = kinds.kind_of(files[item.nodeid], TESTS)
        if kind is not None:  # always, once misplaced() found nothing
            item.add_marker(kind)
    # A test that starts a cluster of its own runs after every test that shares the session's
    # (which stops after its last user): two nodes with the inference image would not fit the
    # disk. Stable, so the rest keeps its order.
    items.sort(key=lambda item: item.get_closest_marker("own_cluster") is not None)
