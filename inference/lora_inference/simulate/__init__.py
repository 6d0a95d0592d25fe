"""A simulated GPU for benchmarks and tests: `lora-inference serve --simulate PROFILE`.

The real server (HTTP API, admission, residency tiers, batching, metrics, the admin endpoints)
around `backend.SimulatedBackend`, a `lora_inference.backend.Backend` that sleeps for the costs a
profile gives (`profile.py`, `profiles/*.json`, each with the measurements it comes from) and
returns small deterministic images; the CLI passes it to the app in place of the diffusers
pipeline. A simulated pod imports no torch, so tens of them fit on a small machine, and a fleet
of them measures routing and placement with a GPU's costs. It is not a model: never serve users
with it.

Nothing here imports torch, diffusers, peft or the real pipeline (lint-imports checks it).
"""

from __future__ import annotations

from lora_inference.simulate.backend import SIMULATED_DEVICE, SimulatedBackend
from lora_inference.simulate.profile import Profile, ProfileError, load_profile

__all__ = ["SIMULATED_DEVICE", "Profile", "ProfileError", "SimulatedBackend", "load_profile"]
