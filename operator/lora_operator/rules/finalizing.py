"""The operator's finalizer on a LoRAAdapter, and what a deletion does next (pure).

The operator holds every adapter with `FINALIZER` so that a deletion waits until no pod serves
it. It adds and removes the finalizer itself: kopf's delete handler would hold a handler, with
its stack and the object's body, for every deletion until the pods have unloaded it (ten
thousand at once after a `kubectl delete --all`).

`patch` writes the change as a JSON patch that applies only to the version of the object it was
computed from, so another controller's finalizer added meanwhile is never dropped; `next_step`
decides a deletion's next step from what the finalizer has done so far.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

FINALIZER = "lora.dev/finalizer"


def patch(finalizers: Sequence[str], resource_version: str, hold: bool) -> list[dict[str, Any]]:
    """The JSON patch that adds (`hold`) or removes the operator's finalizer from an object
    whose `metadata.finalizers` were `finalizers` at `resource_version`; empty when it has (or
    lacks) it already. The test of the version makes the API refuse it (422) once the object
    changed: the change is computed again from the newer object."""
    present = FINALIZER in finalizers
    if present == hold:
        return []
    kept = [f for f in finalizers if f != FINALIZER]
    wanted = [*kept, FINALIZER] if hold else kept
    test = {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version}
    if not wanted:
        return [test, {"op": "remove", "path": "/metadata/finalizers"}]
    # `add` on a member that exists replaces it: one operation whether the list exists or not.
    return [test, {"op": "add", "path": "/metadata/finalizers", "value": wanted}]


class Step(enum.Enum):
    HOLD = "hold"  # add the finalizer (a live adapter without it)
    UNPUBLISH = "unpublish"  # deleting: remove `current`, so no pod resolves it from now on
    WAIT = "wait"  # unpublished; some pod still holds it, within the grace
    RELEASE = "release"  # no pod holds it (or the grace ran out): remove the finalizer
    FORGET = "forget"  # released, or never held: let go of the adapter
    NONE = "none"  # a live adapter that has the finalizer


def next_step(deleting: bool, held: bool, unpublished: bool, unloaded: bool, gave_up: bool) -> Step:
    """What the finalizer does next for an adapter: `held` says the object lists the
    finalizer, `unloaded` that no pod holds the adapter any more, `gave_up` that the grace for
    the pods to unload it ran out."""
    if not deleting:
        return Step.NONE if held else Step.HOLD
    if not unpublished:
        return Step.UNPUBLISH
    if not (unloaded or gave_up):
        return Step.WAIT
    return Step.RELEASE if held else Step.FORGET
