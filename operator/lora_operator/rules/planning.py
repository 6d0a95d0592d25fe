"""What one pod should hold versus what it reports, and the calls that close the gap (pure).

A pod reports its adapters in `GET /v1/models` (`lora_podapi.models`, which reads every version a
pod may send). An adapter the operator loaded is a revision directory of the adapter volume's
layout, `.../<name>/revisions/<sha256>`, and its card says so: it names the LoRAAdapter and the
revision (`report_of` takes a card as the operator's only when they match its name). That is how
the operator recognises its own adapters after a restart without keeping any state, and how it
leaves static (`--lora`) and hand-loaded adapters alone. A card served under a rollout's alias
(`<name>_<sha prefix>`, rollout.py) is the operator's too: it names the adapter and the revision
the alias is made of.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import InitVar, dataclass, field
from pathlib import PurePosixPath
from typing import Any, NamedTuple, Protocol

from lora_podapi import models
from lora_volume import layout

from lora_operator.rules import rollout
from lora_operator.rules.model import AdapterInfo, PodInfo, StagedRef


@dataclass(frozen=True)
class Want:
    """An adapter a pod should hold: at this revision, with this default scale and pin.

    `name` is what the pod serves it as: the adapter's name, or a rollout's alias for it
    (`adapter` is then the LoRAAdapter whose revision it is)."""

    name: str
    sha256: str
    scale: float
    pinned: bool
    adapter: str = ""

    def __post_init__(self) -> None:
        if not self.adapter:
            object.__setattr__(self, "adapter", self.name)


@dataclass(frozen=True)
class Card:
    name: str
    revision: str | None  # the sha256 of its revision directory; None: not one of ours
    scale: float | None  # None when the server does not report it (vLLM)
    pinned: bool | None
    hits: int | None = None  # requests served with it there; None when not reported (vLLM)
    adapter: str | None = None  # the LoRAAdapter it is a revision of (ours only)

    @property
    def managed(self) -> bool:
        return self.revision is not None


class _Tally:
    """What a report derives from its cards, kept card by card: a report after one answered
    call copies its predecessor's (C-level dict copies) and updates it for that card, instead
    of walking every card of the pod again."""

    def __init__(self) -> None:
        self.managed: dict[str, str] = {}  # served name -> revision, the operator's cards
        self.adapters: dict[str, int] = {}  # LoRAAdapter -> the operator's cards naming it
        self.aliases: set[str] = set()  # the operator's cards served under another name
        self.foreign = self.foreign_pinned = 0

    @classmethod
    def of(cls, cards: Mapping[str, Card]) -> _Tally:
        tally = cls()
        for name, card in cards.items():
            tally.count(name, card, 1)
        return tally

    def copy(self) -> _Tally:
        tally = _Tally()
        tally.managed, tally.adapters = dict(self.managed), dict(self.adapters)
        tally.aliases = set(self.aliases)
        tally.foreign, tally.foreign_pinned = self.foreign, self.foreign_pinned
        return tally

    def count(self, name: str, card: Card, sign: int) -> None:
        """Count `card` in (`sign` 1) or out (-1)."""
        if card.revision is None:
            self.foreign += sign
            self.foreign_pinned += sign * bool(card.pinned)
            return
        if sign > 0:
            self.managed[name] = card.revision
        else:
            self.managed.pop(name, None)
        if not card.adapter:
            return
        held = self.adapters.get(card.adapter, 0) + sign
        if held > 0:
            self.adapters[card.adapter] = held
        else:
            self.adapters.pop(card.adapter, None)
        if card.adapter != name:
            if sign > 0:
                self.aliases.add(name)
            else:
                self.aliases.discard(name)


@dataclass(frozen=True)
class PodReport:
    base_model: str | None
    cards: Mapping[str, Card]
    # The pod's adapter capacity, where the server advertises it (GPU slots, CPU-tier size):
    # what placement may give it. None: it does not (vLLM), and it gets no placed adapters.
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    # Derived from the cards once (deletion and collection ask for them for every pod, often;
    # placement's inputs and a pass's plan after every answered call); `answered` passes its
    # own, updated for the one card it changed.
    _tally: _Tally = field(init=False, repr=False, compare=False)
    tally: InitVar[_Tally | None] = None

    def __post_init__(self, tally: _Tally | None) -> None:
        object.__setattr__(self, "_tally", tally if tally is not None else _Tally.of(self.cards))

    def foreign(self) -> tuple[int, int]:
        """How many adapters the pod holds that the operator did not load (`--lora` flags,
        hand loads), and how many of those are pinned."""
        return self._tally.foreign, self._tally.foreign_pinned

    def managed(self) -> Mapping[str, str]:
        """Served name -> revision, for the adapters the operator put on this pod."""
        return self._tally.managed

    def aliases(self) -> Collection[str]:
        """The served names of the operator's cards that are not their adapter's own name (a
        rollout's canary alias)."""
        return self._tally.aliases

    def revisions(self) -> set[tuple[str, str]]:
        """(adapter, revision) of everything the operator put on this pod, aliases included."""
        return {(c.adapter, c.revision) for c in self.cards.values() if c.adapter and c.revision}

    def answered(self, name: str, card: Card | None) -> PodReport:
        """This report after the pod answered a call for `name`: it lists `card` for it now
        (a load's answer), or nothing (an unload's)."""
        cards = dict(self.cards)
        tally = self._tally.copy()
        old = cards.pop(name, None)
        if old is not None:
            tally.count(name, old, -1)
        if card is not None:
            cards[name] = card
            tally.count(name, card, 1)
        return PodReport(self.base_model, cards, self.max_loras, self.max_cpu_loras, tally)

    def holds(self, adapter: str) -> bool:
        """Whether the pod holds a revision of `adapter` that the operator loaded."""
        return adapter in self._tally.adapters


def parse_models(payload: Any) -> PodReport:
    """Read a `/v1/models` answer of any version; raise ValueError when it is not one."""
    return report_of(models.parse(payload))


def report_of(listed: models.ModelList) -> PodReport:
    """The pod's adapters as the operator sees them: a card is the operator's when it names a
    published revision of the adapter it is served as, or of the adapter whose rollout alias
    (`<name>_<sha prefix>`) it is served as."""
    cards = {raw.id: card_of(raw) for raw in listed.cards if raw.parent is not None}
    return PodReport(
        base_model=listed.base,
        cards=cards,
        max_loras=listed.max_loras,
        max_cpu_loras=listed.max_cpu_loras,
    )


def card_of(raw: models.Card) -> Card:
    """An adapter's card as the operator sees it (`report_of`)."""
    adapter, revision = raw.adapter, raw.revision
    if revision is None or adapter not in (raw.id, rollout.adapter_of_alias(raw.id, revision)):
        adapter = revision = None
    return Card(
        name=raw.id,
        revision=revision,
        scale=raw.scale,
        pinned=raw.pinned,
        hits=raw.hits,
        adapter=adapter,
    )


@dataclass(frozen=True)
class Load:
    want: Want
    inplace: bool  # replace a loaded adapter atomically (new revision, scale or pin)

    @property
    def name(self) -> str:
        return self.want.name


@dataclass(frozen=True)
class Unload:
    name: str


@dataclass(frozen=True)
class Conflict:
    """The pod already serves an adapter of this name that the operator did not load."""

    want: Want

    @property
    def name(self) -> str:
        return self.want.name


Action = Load | Unload | Conflict


def plan_pod(
    wants: Mapping[str, Want],
    report: PodReport,
    keep: Collection[str] = (),
    among: Collection[str] | None = None,
) -> list[Action]:
    """The calls that make the pod hold exactly `wants` among the adapters the operator owns.

    `keep`: adapters that exist but whose revision is not known yet (being staged, or not seen
    since a restart): whatever the pod holds of them stays. `among`: the LoRAAdapters this plan
    is about (`wants` and `keep` then say nothing of the others, whose cards stay); None: every
    one. Unloads come first: they free GPU slots a pinned newcomer may need.
    """
    # Planning some adapters looks at their cards alone: by their names and the aliases.
    cards = report.cards
    names = cards if among is None else {n for n in (*among, *report.aliases()) if n in cards}
    actions: list[Action] = [
        Unload(name)
        for name in sorted(names)
        if (held := cards[name]).managed
        and name not in wants
        and name not in keep
        and (among is None or held.adapter in among)
    ]
    for name, want in sorted(wants.items()):
        card = report.cards.get(name)
        if card is None:
            actions.append(Load(want, inplace=False))
        elif not card.managed:
            actions.append(Conflict(want))
        elif not satisfied(want, card):
            actions.append(Load(want, inplace=True))
    return actions


def changed_adapters(before: PodReport, after: PodReport) -> set[str]:
    """The LoRAAdapters (or, for a card not the operator's, the served names) whose cards
    differ between two reports of one pod: what a pass that plans only some adapters must take
    in besides them."""
    changed = {
        card.adapter or name for name, card in after.cards.items() if before.cards.get(name) != card
    }
    changed.update(
        card.adapter or name for name, card in before.cards.items() if name not in after.cards
    )
    return changed


def satisfied(want: Want, card: Card) -> bool:
    """The card shows the wanted revision (and scale and pin, where the server reports them)."""
    return (
        card.revision == want.sha256
        and (card.scale is None or card.scale == want.scale)
        and (card.pinned is None or card.pinned == want.pinned)
    )


def load_path(adapter_root: PurePosixPath, want: Want) -> str:
    """The revision directory as the pod sees it, what its load call names."""
    return str(layout.revision_dir(adapter_root, want.adapter, want.sha256))


class PlacedOn(Protocol):
    """Where placement put an adapter (placement.Placed; planning cannot import placement)."""

    @property
    def pods(self) -> Collection[str]: ...


class Candidate(NamedTuple):
    """An adapter of the pod's namespace as the controller knows it: its spec, the revision it
    staged (None: not yet), the rollout under way, and whether a deletion has unpublished it.
    A tuple: a pass builds one per adapter of the namespace."""

    info: AdapterInfo
    staged: StagedRef | None
    rollout: rollout.Rollout | None = None
    unpublished: bool = False


def plan_wants(
    pod: PodInfo,
    base_model: str | None,
    candidates: Iterable[Candidate],
    placed: Mapping[str, PlacedOn] | None,
    *,
    over: Collection[str] | None = None,
) -> tuple[dict[str, Want], set[str]]:
    """What `pod` should hold, and what it may keep as it is (adapters whose revision is not
    known yet, and deleted ones not unpublished yet).

    `placed`: the pods each placed adapter (spec.replicas or spec.autoscale) is on; None while
    there is no placement yet: a placed adapter then stays as it is. `over`: the pods the
    placement was made from (None: every pod); on a pod it did not count (Ready again after a
    while away, or new) placed adapters stay as they are until a placement counts it, so a pod
    back from a blip is not emptied and filled again.
    """
    wants: dict[str, Want] = {}
    keep: set[str] = set()
    for c in candidates:
        info = c.info
        if info.deleting:
            if not c.unpublished:
                keep.add(info.name)
            continue
        if not info.targets(pod, base_model):
            continue
        if info.placed:
            if (
                placed is None
                or info.name not in placed
                or (over is not None and pod.name not in over)
            ):
                # Not every pod has reported yet, the adapter is newer than the placement, or
                # the pod is: nothing moves until it is placed.
                keep.add(info.name)
                continue
            if pod.name not in placed[info.name].pods:
                continue
        if c.staged is None:
            keep.add(info.name)
            continue
        r = c.rollout
        wants[info.name] = Want(
            name=info.name,
            sha256=r.name_revision if r is not None else c.staged.sha256,
            scale=info.scale,
            pinned=info.pinned,
        )
        if r is not None and r.serves_canary_alias:
            served = rollout.alias(info.name, r.canary)
            wants[served] = Want(
                name=served,
                sha256=r.canary,
                scale=info.scale,
                pinned=False,  # a second pinned slot per pod is more than a pin asks for
                adapter=info.name,
            )
    return wants, keep
