"""Generation requests as data (pure; no aiohttp): the adapter a body names, the body rewritten
for a rollout's canary, the servers' error shape. The headers a proxy passes on are HTTP/1.1's
(`http1.forwarded_headers`).
"""

from __future__ import annotations

import json
from typing import Any

# The paths whose body names an adapter (everything else is routed by load alone).
ADAPTER_PATHS = ("/v1/images/generations",)


def error_body(message: str, error_type: str, status: int) -> dict[str, Any]:
    """The inference server's (vLLM's) error shape."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def adapter_of(body: bytes) -> str | None:
    """The adapter a generation names: `lora.name` (a stack: its first member's), else `model`
    (pure; None: none named or a body the server will refuse, which any pod can do).

    A stack goes where its first member is: any pod that may serve every member builds the stack
    from them, so the first member, the one a client lists first, decides."""
    try:  # the body is bounded (`maxBodyBytes`); its nesting is json's recursion limit
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    lora = parsed.get("lora")
    if isinstance(lora, list) and lora:
        lora = lora[0]
    if isinstance(lora, dict) and isinstance(lora.get("name"), str):
        return str(lora["name"])
    model = parsed.get("model")
    return model if isinstance(model, str) and model else None


def with_adapter(body: bytes, adapter: str, served: str) -> bytes:
    """The generation `body` naming `served` wherever it names `adapter` (`model`, `lora.name`,
    a stack's members): how a request is sent to a rollout's canary (pure)."""
    parsed = json.loads(body)
    if parsed.get("model") == adapter:
        parsed["model"] = served
    lora = parsed.get("lora")
    for member in lora if isinstance(lora, list) else [lora]:
        if isinstance(member, dict) and member.get("name") == adapter:
            member["name"] = served
    return json.dumps(parsed).encode()
