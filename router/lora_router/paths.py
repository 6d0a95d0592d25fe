"""Which requests the router forwards to the pods: an allowlist (pure).

A client reaches the generation API through the router and nothing else: generation is
forwarded; the model list, the playground page and the router's own probes are answered by the
router itself. Every other path (a pod's /metrics, /v1/adapters, load and unload, anything a
later server version adds) is a 404 from the router, never forwarded, so what clients can reach
does not grow with what the pods serve.
"""

from __future__ import annotations

# (method, path) pairs sent on to a pod.
FORWARDED = frozenset({("POST", "/v1/images/generations")})
# Answered by the router itself (its own routes in app.create_app): listed for the 404's message.
ANSWERED = ("GET /", "GET /v1/models", "GET /health", "GET /ready")
PER_POD = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def forwarded(method: str, path: str) -> bool:
    """Whether the router sends `method path` to a pod (pure)."""
    return (method.upper(), path) in FORWARDED


def refusal(method: str, path: str, service: str) -> str:
    """The 404's message for a request the router does not forward (pure)."""
    if path in PER_POD:
        return (
            f"{path} is per pod and the router does not route it: create a LoRAAdapter, or "
            f"call a pod through the Service {service}"
        )
    served = ", ".join([*ANSWERED, *(f"{m} {p}" for m, p in sorted(FORWARDED))])
    return f"{method} {path} is not served by the router; it serves {served}"
