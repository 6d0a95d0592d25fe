"""The suite's layout holds: the unit tests of what the operator image holds (the operator, the
router, the volume contract, the pod API, the runtime) import no torch (the operator image has
none, so nothing of theirs may need it), and every test has its kind's marker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

TORCH_FREE = [
    "tests/unit/operator",
    "tests/unit/router",
    "tests/unit/volume",
    "tests/unit/runtime",
    "tests/unit/podapi",
]

# torch blocked before anything runs: `import torch` anywhere raises ImportError.
COLLECT_WITHOUT_TORCH = (
    "import sys; sys.modules['torch'] = None; import pytest; "
    "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))"
)


def test_the_operator_router_and_volume_unit_tests_collect_without_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", COLLECT_WITHOUT_TORCH, *TORCH_FREE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    summary = out.strip().splitlines()[-1]
    assert " collected" in summary and "error" not in summary, out[-5000:]


def test_every_test_here_is_marked_unit(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("cluster") is None
