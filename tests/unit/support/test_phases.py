"""Naming the phase a long scenario failed in (tests/support/phases.py): the message, the note
when the message is not the first argument, and the fixture and hook in a real pytest run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.phases import name_the_phase


def test_the_message_is_prefixed_on_the_same_exception() -> None:
    error = AssertionError("timed out after 240 s waiting for ns/pixel to be Ready 3/3")
    name_the_phase(error, "scale 2 -> 3")
    assert str(error) == (
        "in phase 'scale 2 -> 3': timed out after 240 s waiting for ns/pixel to be Ready 3/3"
    )
    assert not getattr(error, "__notes__", None)


def test_other_arguments_are_kept() -> None:
    error = KeyError("pixel")
    name_the_phase(error, "deletion")
    assert error.args == ("in phase 'deletion': pixel",)
    raised = OSError(2, "No such file or directory")
    name_the_phase(raised, "deletion")
    assert (raised.errno, raised.strerror) == (2, "No such file or directory")


def test_a_message_not_in_the_first_argument_gets_a_note() -> None:
    error = subprocess.CalledProcessError(1, ["kubectl", "apply"])
    name_the_phase(error, "apply")
    assert error.__notes__ == ["in phase 'apply'"]
    bare = RuntimeError()
    name_the_phase(bare, "apply")
    assert bare.__notes__ == ["in phase 'apply'"]


INNER = """
import pytest

def test_fails_in_the_second_phase(phase):
    phase("first")
    phase("second")
    assert 1 + 1 == 3

def test_raises_in_a_phase(phase):
    phase("the only one")
    raise TimeoutError("nothing came")

def test_passes(phase):
    phase("fine")

def test_skips_untouched(phase):
    phase("skipping")
    pytest.skip("not here")

def test_no_phase_no_prefix():
    assert False, "plain"
"""


def test_the_fixture_names_the_phase_in_the_summary_and_the_traceback(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER))
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA"),
            *("-p", "tests.support.phases", "--rootdir", str(tmp_path)),
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "3 failed, 1 passed, 1 skipped" in out, out
    summary = [line for line in out.splitlines() if line.startswith(("FAILED", "SKIPPED"))]
    assert any(
        "test_fails_in_the_second_phase - AssertionError: in phase 'second': assert" in line
        for line in summary
    ), summary
    assert any("TimeoutError: in phase 'the only one': nothing came" in line for line in summary)
    assert any(line.startswith("SKIPPED") and line.endswith(": not here") for line in summary)
    assert any("test_no_phase_no_prefix - AssertionError: plain" in line for line in summary)
    assert "E       AssertionError: in phase 'second': assert (1 + 1) == 3" in out  # explained


@pytest.mark.parametrize("name", ["apply", "a source update rolls out under load"])
def test_any_name_reads_back(name: str) -> None:
    error = AssertionError("x")
    name_the_phase(error, name)
    assert str(error) == f"in phase {name!r}: x"
