"""The operator refusing adapter volumes it cannot stage on, at start (`volumecheck.check_volume`).

The failing volumes are real file systems mounted in a private mount namespace (root): a
read-only tmpfs, a volume whose `.tmp/` is another file system, and vfat (through fusefat, when
installed). The operator is started as `python -m lora_operator` on each, as in its pod."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

PYTHONPATH = os.pathsep.join(
    str(ROOT / d) for d in ("runtime", "podapi", "inference", "operator", "volume")
)


def _operator_on(
    tmp_path: Path, mount: str, unmount: str = ":"
) -> subprocess.CompletedProcess[str]:
    """Mount a file system with the shell lines in `mount` (in a private mount namespace, `$V`
    being the volume's mount point), start the operator on it, then run `unmount` (which must
    end any process `mount` started: the namespace ends with its last process)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount file systems")
    volume = tmp_path / "volume"
    volume.mkdir()
    # The volume is checked before anything else; no pod is called, so no admin token is needed.
    operator = shlex.join(
        [sys.executable, "-m", "lora_operator", "--standalone", "--no-admin-token"]
    )
    script = (
        f"set -e\nV={shlex.quote(str(volume))}\n{mount}\n"
        f"rc=0; {operator} --volume-root $V || rc=$?\n{unmount}\nexit $rc"
    )
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        check=False,
    )


def _refused(proc: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("lora-operator: the adapter volume "), proc.stderr
    for text in expected:
        assert text in proc.stderr
    assert "Traceback" not in proc.stderr


def test_operator_refuses_a_read_only_volume(tmp_path: Path) -> None:
    proc = _operator_on(tmp_path, "mount -t tmpfs -o ro tmpfs $V")
    _refused(proc, "could not write a file", "mounted read-only", "needs a POSIX file system")


def test_operator_refuses_a_volume_whose_tmp_is_another_file_system(tmp_path: Path) -> None:
    proc = _operator_on(
        tmp_path, "mount -t tmpfs tmpfs $V\nmkdir $V/.tmp\nmount -t tmpfs t $V/.tmp"
    )
    _refused(proc, "could not hard-link a file into .objects/", "different file systems")


def test_operator_refuses_vfat(tmp_path: Path) -> None:
    if not (shutil.which("mkfs.vfat") and shutil.which("fusefat")):
        pytest.skip("needs dosfstools (mkfs.vfat) and fusefat for a vfat volume")
    image = tmp_path / "vfat.img"
    with image.open("wb") as f:
        f.truncate(8 * 1024 * 1024)
    subprocess.run(["mkfs.vfat", str(image)], check=True, capture_output=True)
    # In the foreground (-f), so that unmounting ends it and the test waits for it.
    mount = (
        f"fusefat -f -o rw+ {shlex.quote(str(image))} $V >/dev/null 2>&1 & FUSE=$!\n"
        "for _ in $(seq 100); do mountpoint -q $V && break; sleep 0.1; done"
    )
    proc = _operator_on(tmp_path, mount, unmount="fusermount -u $V; wait $FUSE")
    _refused(proc, "could not hard-link a file into .objects/", "no hard links or symbolic links")
