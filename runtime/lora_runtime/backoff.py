"""How long to wait before a retry: the one backoff formula of the product (pure).

Pod loads and reads, staging, downloads, the peering watch and the router's API watches all wait
`delay(n)` before their n-th retry: `first`, twice that, four times ... capped at `cap`, so
retries never storm and never stop. Each caller keeps its own count and picks its own `first`
and `cap`.
"""

from __future__ import annotations


def delay(attempt: int, *, cap: float, first: float = 1.0) -> float:
    """Seconds before retry number `attempt` (1 for the first retry): `first` x 2^(attempt-1),
    at most `cap`."""
    return float(min(cap, first * 2 ** max(0, attempt - 1)))
