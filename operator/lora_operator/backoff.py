"""The backoff formula is `lora_runtime.backoff`'s, shared with the router; this module goes
with its place in the import contracts' list of pure modules."""

from __future__ import annotations

from lora_runtime.backoff import delay as delay
