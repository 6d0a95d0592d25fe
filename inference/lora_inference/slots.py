"""The LoRA slots of one pipeline: fixed buffers, filled by one copy, run as one gathered pass.

At start every Linear and Conv2d of the adaptable components gets room in one buffer for all
slots, in the model's dtype on its device: per layer `A [slots+1, r_max, fan_in]` and
`B [slots+1, fan_out, r_max]`, where row 0 is a slot of zeros for base-model images. The buffer
is laid out slot-major, then rank-major (`SlotLayout`): a slot's row is `r_max` planes, plane `i`
holding row `i` of every layer's A and column `i` of every layer's B, the layers adapters target
most first (attention projections). So everything an adapter of rank r needs is the first r
planes of a row, each cut to the prefix its layers' rooms lie in (its extent): it is packed once
on the CPU into those (`slot_packing.pack`: each layer's scaling alpha / r folded into B, zeros
where a layer's rank is lower or a layer in the prefix is not its), the CPU tier keeps only that,
and putting it in a slot is one copy of it (strided where the extent is not the whole plane), and
zeroing what a previous occupant left outside it, never a loop over layers. On a GPU the planes
are packed straight into pinned memory and the copy runs on a side stream, ordered before the
call that uses them.

A call sets which slot each image uses (`call`): forward hooks on the base layers add each
image's branch, `scale x B @ A @ x`, in one pass per layer whatever the number of adapters: the
rows' A and B gathered by a per-row slot index, two batched products, one add. The rank of that
pass is the largest of the call's adapters on that layer (padding with zeros adds exact zeros). A
call of one adapter indexes its slot directly, and merges it into the layers the cost model
chooses (`W += scale x B @ A`, restored afterwards from a pristine copy, never by subtracting).
Biases an adapter trained on its B (peft's lora_bias) and DoRA's magnitudes are added by the
same hooks, per image at its scale (`output_terms`); such layers always run as a branch. Layers
no adapter of the call targets run their base layer alone, bit-identical to a model that never
held an adapter, and so does every layer outside a call.

Runs on the pipeline thread only, apart from `pack` (any thread: touches no buffer); nothing here
is thread-safe. Imports torch, never diffusers or peft.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lora_inference import merging, output_terms, slot_packing
from lora_inference.backend import LayerKey
from lora_inference.slot_layout import SlotLayout
from lora_inference.slot_packing import LayerWeights

__all__ = ["LayerKey", "SlotLayout", "Slots"]


@dataclass
class _Call:
    """What the hooks read during one pipeline call."""

    images: int
    ranks: dict[LayerKey, int]  # per layer with a branch this call: the rank of its pass
    single: int | None  # the slot index when every image uses one slot
    scale: float  # that slot's scale
    index: torch.Tensor | None  # per image: its slot index (0: the base model)
    scales: torch.Tensor | None  # per image: its scale
    by_repeats: dict[int, tuple[torch.Tensor, torch.Tensor]]
    terms: frozenset[LayerKey] = frozenset()  # layers where an image's adapter has output terms

    def rows(self, repeats: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-row index and scale when a layer sees the images `repeats` times (under
        classifier-free guidance, [unconditional, conditional] halves)."""
        cached = self.by_repeats.get(repeats)
        if cached is None:
            if self.index is None or self.scales is None:
                raise RuntimeError("a call of one slot has no per-row index")
            cached = (self.index.repeat(repeats), self.scales.repeat(repeats))
            self.by_repeats[repeats] = cached
        return cached


class Slots:
    """Fixed LoRA slot buffers for the Linear and Conv2d layers of one pipeline's components."""

    def __init__(
        self, components: Mapping[str, torch.nn.Module], *, count: int, max_rank: int
    ) -> None:
        # Linear or Conv2d; Any: nn.Module's attributes type as Tensor | Module.
        self._modules: dict[LayerKey, Any] = {}
        shapes: dict[LayerKey, tuple[int, int, tuple[int, int] | None]] = {}
        for component, model in components.items():
            for path, module in model.named_modules():
                if isinstance(module, torch.nn.Linear):
                    shapes[(component, path)] = (module.in_features, module.out_features, None)
                elif isinstance(module, torch.nn.Conv2d) and _plain_conv(module):
                    kernel = (int(module.kernel_size[0]), int(module.kernel_size[1]))
                    shapes[(component, path)] = (module.in_channels, module.out_channels, kernel)
                else:
                    continue
                self._modules[(component, path)] = module
        self.layout = SlotLayout.plan(shapes, max_rank)
        self.count = count
        first = next(iter(self._modules.values()), None)
        weight: torch.Tensor = first.weight if first is not None else torch.empty(0)
        self.device: torch.device = weight.device
        self.dtype: torch.dtype = weight.dtype
        self.pinned = self.device.type == "cuda"
        # Row 0 stays zeros: the slot of base-model images in a mixed call.
        self._rows = torch.zeros(
            count + 1, self.layout.row_elements, device=self.device, dtype=self.dtype
        )
        # Biases and DoRA (rare) beside the planes: see output_terms.
        self._terms = output_terms.OutputTerms(
            {k: (room.bias_offset, room.fan_out) for k, room in self.layout.rooms.items()},
            self._modules,
            count=count,
            device=self.device,
            dtype=self.dtype,
        )
        self._with_terms: dict[str, frozenset[LayerKey]] = {}  # slot name -> layers with terms
        # Per layer, strided views of every slot's A [slots+1, r_max, fan_in] and
        # B [slots+1, fan_out, r_max] inside the rows.
        self._a: dict[LayerKey, torch.Tensor] = {}
        self._b: dict[LayerKey, torch.Tensor] = {}
        row, plane = self.layout.row_elements, self.layout.plane_elements
        for key, room in self.layout.rooms.items():
            self._a[key] = self._rows.as_strided(
                (count + 1, max_rank, room.fan_in), (row, plane, 1), room.a_offset
            )
            self._b[key] = self._rows.as_strided(
                (count + 1, room.fan_out, max_rank), (row, 1, plane), room.b_offset
            )
        # Per row: the planes its occupant filled, and the prefix of each (`pack`).
        self._filled = [(0, 0)] * (count + 1)
        self._index: dict[str, int] = {}  # slot name -> row
        self._free = list(range(count, 0, -1))
        self._held: dict[str, dict[LayerKey, int]] = {}  # slot name -> rank per targeted layer
        self._hooked: set[LayerKey] = set()
        self.base = merging.BaseWeights(self._modules)  # merges into the base weights
        self._call: _Call | None = None
        self._stream = (
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self.pinned
            else None
        )

    @property
    def row_bytes(self) -> int:
        """What one slot takes (an adapter packed at the slots' maximum rank takes as much)."""
        return self.layout.row_elements * self._rows.element_size()

    # -- packing (any thread) -------------------------------------------------------------------

    def pack(self, layers: Mapping[LayerKey, LayerWeights]) -> torch.Tensor:
        """`layers` packed into this buffer's layout (`slot_packing.pack`)."""
        return slot_packing.pack(
            self.layout, layers, dtype=self.dtype, pinned=self.pinned, check=self._terms.check
        )

    # -- placing (pipeline thread) --------------------------------------------------------------

    def place(
        self,
        slot: str,
        layers: Mapping[LayerKey, LayerWeights],
        packed: torch.Tensor | None = None,
    ) -> None:
        """Put an adapter (`layers`, packed by `pack`) into `slot`, replacing what it held.

        One copy of the packed planes into the first planes of the slot's row (each plane cut
        to their extent: a strided copy when that is not all of it), and zeros over what a
        previous occupant left outside them. On any failure the slot is left empty; other slots
        and the base layers are untouched either way.
        """
        index = self._index.get(slot)
        if index is None:
            if not self._free:
                raise RuntimeError(f"all {self.count} slots are taken; {slot} has none")
            index = self._free.pop()
            self._index[slot] = index
        self._held.pop(slot, None)
        try:
            planes = self.pack(layers) if packed is None else packed
            rank, extent = planes.shape
            old_rank, old_extent = self._filled[index]
            # Until the copy is done, what may be nonzero is the larger of the two (`clear`).
            self._filled[index] = (max(rank, old_rank), max(extent, old_extent))
            row = self._rows[index].view(self.layout.max_rank, self.layout.plane_elements)
            if self._stream is not None:
                # A side stream, so the copy overlaps work already queued; the call waits for it.
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    row[:rank, :extent].copy_(planes, non_blocking=True)
                    _zero_outside(row, (rank, extent), (old_rank, old_extent))
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            else:
                row[:rank, :extent].copy_(planes)
                _zero_outside(row, (rank, extent), (old_rank, old_extent))
            self._filled[index] = (rank, extent)
            with_terms = self._terms.place(index, layers)
        except BaseException:
            self.clear(slot)
            raise
        self._with_terms[slot] = with_terms
        self._held[slot] = {key: weights.rank for key, weights in layers.items()}
        for key in layers.keys() - self._hooked:
            self._hook(key)

    def clear(self, slot: str) -> None:
        """Empty `slot`: its row becomes zeros and free again."""
        self._held.pop(slot, None)
        self._with_terms.pop(slot, None)
        index = self._index.pop(slot, None)
        if index is not None:
            rank, extent = self._filled[index]
            row = self._rows[index].view(self.layout.max_rank, self.layout.plane_elements)
            row[:rank, :extent].zero_()
            self._terms.clear(index)
            self._filled[index] = (0, 0)
            self._free.append(index)

    def held(self) -> set[str]:
        return set(self._held)

    def footprint(self, slot: str) -> Mapping[LayerKey, int]:
        """The layers `slot`'s adapter targets, with its rank on each."""
        return self._held.get(slot, {})

    # -- per call -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def call(
        self,
        per_image: Sequence[str | None],
        scales: Mapping[str, float],
        *,
        merged: Collection[LayerKey] = (),
    ) -> Iterator[None]:
        """Run each image through its slot (None: the base model) for one pipeline call.

        `merged` (a call of one slot only): layers whose base weight takes the slot's delta for
        the call instead of running a branch; restored from pristine copies afterwards.
        """
        kinds = {s for s in per_image if s is not None}
        for slot in kinds:
            if slot not in self._held:
                raise RuntimeError(f"slot {slot} holds no adapter")
        if merged and (len(kinds) != 1 or None in per_image):
            raise ValueError("only a call of one adapter merges")
        terms = frozenset().union(*(self._with_terms.get(slot, frozenset()) for slot in kinds))
        # A layer with output terms keeps its branch (output_terms says why).
        merged = [key for key in merged if key not in terms]
        ranks: dict[LayerKey, int] = {}
        for slot in kinds:
            for key, rank in self._held[slot].items():
                if key not in merged:
                    ranks[key] = max(rank, ranks.get(key, 0))
        single = len(kinds) == 1 and None not in per_image
        if not kinds:
            self._call = None
        elif single:
            (slot,) = kinds
            self._call = _Call(
                len(per_image), ranks, self._index[slot], scales[slot], None, None, {}, terms
            )
        else:
            index = [0 if s is None else self._index[s] for s in per_image]
            scale = [0.0 if s is None else scales[s] for s in per_image]
            self._call = _Call(
                images=len(per_image),
                ranks=ranks,
                single=None,
                scale=0.0,
                index=torch.tensor(index, device=self.device),
                scales=torch.tensor(scale, device=self.device, dtype=self.dtype),
                by_repeats={},
                terms=terms,
            )
        try:
            with self._merged(next(iter(kinds)) if merged else "", merged, scales):
                yield
        finally:
            self._call = None

    @contextlib.contextmanager
    def _merged(
        self, slot: str, keys: Collection[LayerKey], scales: Mapping[str, float]
    ) -> Iterator[None]:
        """Add `slot`'s delta at its scale to the base weights of `keys` for the block, restored
        from pristine copies afterwards (`merging.BaseWeights`)."""
        with self.base.restoring() as take:
            with torch.no_grad():
                for key in keys:
                    weight, _ = take(key, "weight")
                    weight.add_(self.delta(slot, key, scales[slot]).to(weight.dtype))
            yield

    def delta_factors(self, slot: str, key: LayerKey) -> tuple[torch.Tensor, torch.Tensor]:
        """`slot`'s A and B (scaling folded in) on `key`, at its rank: views of the buffers."""
        rank = self._held[slot][key]
        index = self._index[slot]
        return self._a[key][index, :rank], self._b[key][index, :, :rank]

    def delta(self, slot: str, key: LayerKey, scale: float) -> torch.Tensor:
        """`scale x B @ A` of `slot` on `key`, shaped as the layer's weight."""
        a, b = self.delta_factors(slot, key)
        return ((b @ a) * scale).view_as(self._modules[key].weight)

    def bias_delta(self, slot: str, key: LayerKey, scale: float) -> torch.Tensor:
        """What `slot` adds to `key`'s output besides `delta` (its bias), at `scale`."""
        return self._terms.bias_delta(self._index[slot], key, scale)

    def gain(self, slot: str, key: LayerKey, scale: float) -> torch.Tensor:
        """DoRA's per-row gain of `slot` on `key` at `scale` (ones without DoRA)."""
        return self._terms.gain(self._index[slot], key, scale)

    # -- the hooks ------------------------------------------------------------------------------

    def _hook(self, key: LayerKey) -> None:
        module = self._modules[key]
        a_all, b_all = self._a[key], self._b[key]
        conv = isinstance(module, torch.nn.Conv2d)

        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
            call = self._call
            if call is None:
                return None
            rank = call.ranks.get(key)
            if rank is None:
                return None
            x = args[0]
            a, b = a_all[:, :rank], b_all[:, :, :rank]
            if conv:
                branch = _conv_branch(module, x, a, b, call, rank)
            elif call.single is not None:
                branch = F.linear(F.linear(x, a[call.single]) * call.scale, b[call.single])
            else:
                rows = int(x.shape[0])
                index, scales = call.rows(_repeats(rows, call.images))
                flat = x.reshape(rows, -1, x.shape[-1])
                inner = torch.bmm(flat, a[index].transpose(1, 2)) * scales.view(-1, 1, 1)
                branch = torch.bmm(inner, b[index].transpose(1, 2))
            branch = branch.view(output.shape).to(output.dtype)
            if key in call.terms:
                if call.single is not None:
                    index = torch.tensor([call.single])
                    scales = torch.tensor([call.scale], dtype=torch.float64)
                else:
                    index, scales = call.rows(_repeats(int(output.shape[0]), call.images))
                return self._terms.apply(key, output, branch, index, scales, conv=conv)
            output += branch
            return output

        module.register_forward_hook(hook)
        self._hooked.add(key)


def _conv_branch(
    module: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, call: _Call, rank: int
) -> torch.Tensor:
    """A Conv2d layer's branch: A is a conv of the base layer's geometry, B a 1x1 conv. Mixed
    calls run every image's A and B as one grouped convolution each (one group per image)."""
    geometry = {"stride": module.stride, "padding": module.padding, "dilation": module.dilation}
    kernel = module.kernel_size
    if call.single is not None:
        inner = F.conv2d(x, a[call.single].reshape(rank, -1, *kernel), **geometry) * call.scale
        return F.conv2d(inner, b[call.single].reshape(-1, rank, 1, 1))
    rows = int(x.shape[0])
    index, scales = call.rows(_repeats(rows, call.images))
    weights_a = a[index].reshape(rows * rank, -1, *kernel)
    inner = F.conv2d(x.reshape(1, -1, *x.shape[2:]), weights_a, groups=rows, **geometry)
    inner = inner.view(rows, rank, *inner.shape[2:]) * scales.view(-1, 1, 1, 1)
    weights_b = b[index].reshape(-1, rank, 1, 1)
    out = F.conv2d(inner.reshape(1, rows * rank, *inner.shape[2:]), weights_b, groups=rows)
    return out.view(rows, -1, *out.shape[2:])


def _zero_outside(row: torch.Tensor, new: tuple[int, int], old: tuple[int, int]) -> None:
    """Zero what the previous occupant of `row` (viewed as planes) filled, `old` planes of an
    `old` prefix each, outside the `new` occupant's."""
    (rank, extent), (old_rank, old_extent) = new, old
    if old_extent > extent:
        row[: min(rank, old_rank), extent:old_extent].zero_()
    if old_rank > rank:
        row[rank:old_rank, :old_extent].zero_()


def _plain_conv(module: torch.nn.Conv2d) -> bool:
    """A Conv2d a LoRA can target: one group, zero padding (diffusers' every one)."""
    return module.groups == 1 and module.padding_mode == "zeros"


def _repeats(rows: int, images: int) -> int:
    """How many times a layer's input repeats the batch (classifier-free guidance: twice)."""
    if rows % images:
        raise RuntimeError(f"a LoRA layer saw {rows} rows for a batch of {images} images")
    return rows // images
