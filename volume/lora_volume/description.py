"""What an adapter file declares about itself: its format, its rank, the pipeline components it
targets and its trigger words (pure: reads a parsed safetensors header, never a tensor).

The operator shows it in a LoRAAdapter's status (`status.adapter`) from the header of the file
it staged; the server shows the same facts per adapter on `/v1/adapters` from its own
conversion. The two agree on the words: the format keys are `lora_volume.formats`', the
component names are the pipeline's (`unet` or `transformer`, `text_encoder`, `text_encoder_2`,
`text_encoder_3`), and a composition is a `stack`.

The rank is the file's declared one: the largest inner dimension of its low-rank factors, read
from the tensor shapes. For a plain LoRA (and LoCon, DoRA, XLabs) that is the rank the server
serves. A LoHa's delta is a Hadamard product of two rank-r factors and a LoKr's a Kronecker
product with a rank-r factor: the server serves them as plain pairs whose rank is r x r (LoHa)
or up to r times the other factor's size (LoKr), less after an exact compression, so its rank
for those can differ from this one. A file with no low-rank factor (whole-matrix differences
only) declares rank 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lora_volume import files, formats

# A composition of staged adapters: the server's word for the same thing on /v1/adapters.
STACK = formats.Format("stack", "Stack of adapters")
_BY_KEY = {f.key: f for f in (*formats.SERVED, STACK)}
# A longer "word" is no trigger word but a caption, or a hostile file's way to make the status
# an API write too large to accept (the metadata may fill an 8 MiB header): left out.
MAX_WORD_CHARS = 100

# Component names as diffusers' pipelines (and so the server's `targets`) spell them.
_COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
# kohya / sd-scripts prefixes (`lora_unet_` is the denoiser, whichever it is).
_KOHYA = (
    ("lora_unet_", None),
    ("lora_transformer_", "transformer"),
    ("lora_te1_", "text_encoder"),
    ("lora_te_", "text_encoder"),
    ("lora_te2_", "text_encoder_2"),
    ("lora_te3_", "text_encoder_3"),
    ("text_encoders.clip_l.", "text_encoder"),  # ComfyUI's Flux layout
    ("diffusion_model.", None),
)
# A denoiser whose top-level blocks are these is a transformer (Flux, SD 3); a UNet's
# transformer blocks sit inside its down/mid/up blocks, never at the top.
_TRANSFORMER_BLOCKS = re.compile(
    r"^(double_blocks|single_blocks|joint_blocks|transformer_blocks|single_transformer_blocks)[._]"
)
# The low-rank factors' sides: the rank is a down factor's first dimension, an up factor's second.
_DOWN = re.compile(r"(lora_A|[._]down)(\.[^.]+)?\.weight$|\.(hada|lokr)_w[12]_b$")
_UP = re.compile(r"(lora_B|[._]up)(\.[^.]+)?\.weight$|\.(hada|lokr)_w[12]_a$")


@dataclass(frozen=True)
class Description:
    """What an adapter declares: `targets` sorted, `trigger_words` in order of importance."""

    format: formats.Format
    rank: int
    targets: tuple[str, ...]
    trigger_words: tuple[str, ...]


def describe(header: files.SafetensorsHeader, *, name: str = "adapter") -> Description:
    """The description of a LoRA file from its header; InvalidAdapter, as `files.check_lora_keys`
    says, when it is not a format that is served."""
    keys = list(header.tensors)
    return Description(
        format=files.check_lora_keys(keys, name=name),
        rank=declared_rank(header),
        targets=target_families(keys),
        trigger_words=tuple(w for w in files.trigger_words(header) if len(w) <= MAX_WORD_CHARS),
    )


def stacked(members: Sequence[Description]) -> Description:
    """A composition of `members` (in their order): a `stack`, whose rank is the sum of its
    members' ranks (a stack concatenates their factors along the rank), targeting what any of
    them targets, with their trigger words in member order, each once."""
    return Description(
        format=STACK,
        rank=sum(m.rank for m in members),
        targets=tuple(sorted({t for m in members for t in m.targets})),
        trigger_words=tuple(dict.fromkeys(w for m in members for w in m.trigger_words)),
    )


def format_by_key(key: str) -> formats.Format:
    """The format a `Format.key` names (an unknown key, from another release: itself)."""
    return _BY_KEY.get(key, formats.Format(key, key))


def declared_rank(header: files.SafetensorsHeader) -> int:
    """The largest inner dimension of the file's low-rank factors (0: it has none)."""
    rank = 0
    for key, entry in header.tensors.items():
        if len(entry.shape) < 2:
            continue
        if _DOWN.search(key):
            rank = max(rank, entry.shape[0])
        elif _UP.search(key):
            rank = max(rank, entry.shape[1])
    return rank


def target_families(keys: Iterable[str]) -> tuple[str, ...]:
    """The pipeline components tensors named `keys` change, sorted: from diffusers' and peft's
    prefixes (`unet.`, `text_encoder_2.`, ...), kohya's (`lora_unet_`, `lora_te1_`, ...), or,
    with none, the denoiser's (a state dict without components is the denoiser's, as diffusers
    reads it). A denoiser is `transformer` when its top-level blocks are a transformer's."""
    families: set[str] = set()
    denoiser_paths: list[str] = []
    for key in keys:
        key = key.removeprefix("base_model.model.")
        component = key.partition(".")[0]
        if component in _COMPONENTS:
            families.add(component)
            continue
        prefix, family = next(((p, f) for p, f in _KOHYA if key.startswith(p)), ("", None))
        if family is not None:
            families.add(family)
        else:
            denoiser_paths.append(key.removeprefix(prefix))
    if denoiser_paths:
        transformer = any(_TRANSFORMER_BLOCKS.match(p) for p in denoiser_paths)
        families.add("transformer" if transformer else "unet")
    return tuple(sorted(families))
