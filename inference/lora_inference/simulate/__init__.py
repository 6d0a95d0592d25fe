"""A simulated GPU for benchmarks and tests: `lora-inference serve --simulate PROFILE`.

The real server (HTTP API, admission, residency tiers, batching, metrics, the admin endpoints)
with its pipeline replaced by `backend.SimulatedBackend`, which sleeps for the costs a profile
gives (`profile.py`, `profiles/*.json`, each with the measurements it comes from) and returns
small deterministic images. A simulated pod imports no torch, so tens of them fit on a small
machine, and a fleet of them measures routing and placement with a GPU's costs. It is not a
model: never serve users with it.

The server's modules import `lora_inference.pipeline` (and `lora_inference.stacking`), which
import torch and diffusers, at import. `stand_in()` makes this process's
`lora_inference.pipeline` this package's `backend` module and its `stacking` the torch-free one,
before anything imports the server; the CLI calls it first thing for `serve --simulate`. A test
checks that they define every name the server imports from the real modules, with the same
fields.

Nothing here imports torch, diffusers, peft or the real pipeline (lint-imports checks it).
"""

from __future__ import annotations

import sys

from lora_inference.simulate import backend, stacking
from lora_inference.simulate.backend import SimulatedBackend
from lora_inference.simulate.profile import Profile, ProfileError, load_profile

__all__ = ["Profile", "ProfileError", "SimulatedBackend", "load_profile", "stand_in"]

# The real module -> the one that stands in for it in a simulated server's process.
STAND_INS = {"lora_inference.pipeline": backend, "lora_inference.stacking": stacking}


def stand_in() -> None:
    """Make `lora_inference.pipeline` and `lora_inference.stacking` the simulated ones in this
    process. RuntimeError when the real ones are already imported (torch with them)."""
    import lora_inference

    for name, module in STAND_INS.items():
        present = sys.modules.get(name)
        if present is module:
            continue
        if present is not None:
            raise RuntimeError(
                f"{name} is already imported: a simulated server must stand in for it first"
            )
        sys.modules[name] = module
        setattr(lora_inference, name.rpartition(".")[2], module)
