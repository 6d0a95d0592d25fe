"""How the operator proves itself to an inference pod, for both sides (pure).

The operator calls a pod's load and unload endpoints with a token of its own ServiceAccount
from the TokenRequest API, bound to one audience per namespace; the pod accepts a token only
when the API server's TokenReview says it is valid for the pod's own namespace's audience and
belongs to the operator's ServiceAccount. So a token sent to (or collected in) one namespace
opens no pod of another, and no long-lived secret has to live where tenants run pods.
"""

from __future__ import annotations

AUDIENCE_PREFIX = "lora.dev/inference/"


def audience(namespace: str) -> str:
    """The audience of the tokens that open the inference pods of `namespace`."""
    return AUDIENCE_PREFIX + namespace


def service_account_user(namespace: str, name: str) -> str:
    """The user name the API server gives a ServiceAccount's tokens (TokenReview's answer)."""
    return f"system:serviceaccount:{namespace}:{name}"
