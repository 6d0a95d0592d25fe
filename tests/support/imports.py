"""What a fresh interpreter loads when it imports every module of some packages: how the tests
check that a package needs no torch (nor kopf, nor another package) at run time, whatever the
test process itself has loaded already."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable

_SCRIPT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    packages = [importlib.import_module(name) for name in sys.argv[1:]]
    names = [
        m.name
        for pkg in packages
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
    ]
    for name in names:
        importlib.import_module(name)
    print(json.dumps({"modules": names, "loaded": sorted({n.split(".")[0] for n in sys.modules})}))
    """
)


def import_everything(packages: Iterable[str]) -> tuple[list[str], set[str]]:
    """Every module of `packages` imported in a fresh interpreter: (the modules imported, the
    top-level packages loaded by then)."""
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *packages],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    return list(found["modules"]), set(found["loaded"])
