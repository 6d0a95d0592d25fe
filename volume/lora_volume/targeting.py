"""Which pods an adapter on the volume is meant for, and whether this pod is one of them.

The operator publishes, next to each adapter it stages, the LoRAAdapter's `spec.selector` and
`baseModel` (a `Target`, layout.TARGET); a server that knows its own pod labels (a Downward API
file) resolves from the volume only the adapters whose target matches it, as the operator would
load them. Both sides use this module, so they cannot disagree on what a selector means.

Purely computational: parses and decides; reading and writing the files is the caller's job.
Imports only the standard library.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Requirement:
    """One `matchExpressions` entry of a LabelSelector."""

    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist (the CRD allows nothing else)
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class Selector:
    """A Kubernetes LabelSelector; the empty selector matches every pod."""

    match_labels: tuple[tuple[str, str], ...] = ()
    expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if not self.match_labels and not self.expressions:
            return True  # most adapters: asked for every pass of every pod, so kept cheap
        if any(labels.get(k) != v for k, v in self.match_labels):
            return False
        return all(_satisfies(r, labels) for r in self.expressions)

    def to_spec(self) -> dict[str, Any]:
        """The selector as a LoRAAdapter's `spec.selector` spells it (`parse_selector`'s input)."""
        spec: dict[str, Any] = {}
        if self.match_labels:
            spec["matchLabels"] = dict(self.match_labels)
        if self.expressions:
            spec["matchExpressions"] = [
                {"key": r.key, "operator": r.operator, "values": list(r.values)}
                for r in self.expressions
            ]
        return spec


def _satisfies(r: Requirement, labels: Mapping[str, str]) -> bool:
    present = r.key in labels
    if r.operator == "In":
        return present and labels[r.key] in r.values
    if r.operator == "NotIn":
        return not present or labels[r.key] not in r.values
    if r.operator == "Exists":
        return present
    if r.operator == "DoesNotExist":
        return not present
    raise ValueError(f"unknown label selector operator {r.operator!r}")


def parse_selector(raw: Mapping[str, Any] | None) -> Selector:
    raw = raw or {}
    labels = tuple(sorted((str(k), str(v)) for k, v in (raw.get("matchLabels") or {}).items()))
    expressions = tuple(
        Requirement(
            key=str(e["key"]),
            operator=str(e["operator"]),
            values=tuple(str(v) for v in e.get("values") or ()),
        )
        for e in raw.get("matchExpressions") or ()
    )
    return Selector(match_labels=labels, expressions=expressions)


@dataclass(frozen=True)
class Target:
    """What selects the pods an adapter is for: its LoRAAdapter's baseModel and selector."""

    base_model: str
    selector: Selector = Selector()

    def to_json(self) -> str:
        return json.dumps(
            {"baseModel": self.base_model, "selector": self.selector.to_spec()}, sort_keys=True
        )


def parse_target(text: str) -> Target:
    """Read `Target.to_json`'s output; ValueError when it is not one."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not an adapter target: not a JSON object")
        return Target(
            base_model=str(raw.get("baseModel") or ""),
            selector=parse_selector(raw.get("selector")),
        )
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"not an adapter target: {e}") from e


def parse_pod_labels(text: str) -> dict[str, str]:
    """The Downward API's `metadata.labels` file: one `key="value"` a line (Go-quoted values,
    which for label values, letters, digits and `-_.`, JSON reads the same)."""
    labels: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, quoted = line.partition("=")
        if not sep or not key.strip():
            continue
        try:
            value = json.loads(quoted)
        except json.JSONDecodeError:
            value = quoted.strip('"')
        labels[key.strip()] = str(value)
    return labels


def refusal(target: Target, labels: Mapping[str, str], model_id: str) -> str | None:
    """Why a pod with `labels` serving `model_id` must not serve an adapter for `target`, or
    None when it may: the operator's own rule (same base model, selector matches)."""
    if target.base_model and target.base_model != model_id:
        return f"it is for base model {target.base_model!r}, and this pod serves {model_id!r}"
    if not target.selector.matches(labels):
        return (
            f"its LoRAAdapter's selector {json.dumps(target.selector.to_spec(), sort_keys=True)} "
            "does not match this pod's labels"
        )
    return None
