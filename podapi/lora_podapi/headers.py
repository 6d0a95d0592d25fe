"""The headers of a generation's answer, for the router and for clients (pure).

`x-lora-queue`: the pod's requests waiting and running as the answer leaves (that request no
longer counted), so a router learns a pod's queue from every answer between its polls.
`x-lora-model` and `x-lora-revision`: what the images were made with (`served`).
"""

from __future__ import annotations

from collections.abc import Iterable

QUEUE = "x-lora-queue"
MODEL = "x-lora-model"
REVISION = "x-lora-revision"


def served(model: str, revision: str | None) -> dict[str, str]:
    """`x-lora-model`, the adapter's name on the server (a rollout's canary: its alias; a stack:
    its members at their scales) or the base model's id, and `x-lora-revision`, the sha256 of
    the adapter's weights (a stack's: of its members'), when an adapter made the images."""
    return {MODEL: model} if revision is None else {MODEL: model, REVISION: revision}


def render_queue(length: int) -> str:
    return str(length)


def parse_queue(headers: Iterable[tuple[str, str]]) -> int | None:
    """The queue an answer reports (`x-lora-queue`), or None when it has none."""
    for name, value in headers:
        if name.lower() == QUEUE:
            return int(value) if value.isascii() and value.isdigit() else None
    return None
