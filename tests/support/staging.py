"""What the staging tests share: a store that retries fast and may fetch from the test servers
on 127.0.0.1 (any host name, the loopback range opened, as `--source-host '*'
--source-allow-cidr 127.0.0.0/8` would), the namespace they stage into, and what a staging
left on the volume (what a pod could see; what is under `.tmp/`).

Imports no torch (the operator's unit tests collect without it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lora_operator.rules import consent
from lora_operator.store import downloads, egress, fetchers, staging
from lora_volume import layout

FAST = downloads.RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.02)
NS = "team-a"
LOCAL = consent.Rules(hosts=("*",), allow=consent.parse_networks(["127.0.0.0/8"]))


def make_store(
    root: Path,
    *,
    rules: consent.Rules = LOCAL,
    policy: downloads.RetryPolicy = FAST,
    hf_endpoint: str | None = None,
    **kwargs: Any,
) -> staging.Store:
    """A store whose fetches are checked against `rules`, as the operator's are."""
    fetch = fetchers.Fetcher(root, egress.Guard(rules), policy=policy, hf_endpoint=hf_endpoint)
    return staging.Store(root, policy=policy, hf_endpoint=hf_endpoint, fetch=fetch, **kwargs)


def visible(root: Path) -> list[str]:
    """Everything a pod could see: the namespaces' trees (not .tmp/ nor .objects/)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if not p.relative_to(root).parts[0].startswith(".")
    )


def tmp_entries(root: Path) -> list[str]:
    tmp = layout.tmp_dir(root)
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []
