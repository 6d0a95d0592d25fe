"""Which adapter format a file's tensor names say it is, and whether it is served (pure).

Adapters come from many trainers, and each writes its own names: peft and diffusers (`lora_A`,
`lora_B`), kohya and A1111 (`lora_down`, `lora_up`, `alpha`), LyCORIS (LoCon's `lora_mid`, LoHa's
`hada_*`, LoKr's `lokr_*`, OFT, GLoRA, (IA)3, full differences), XLabs for Flux
(`processor.qkv_lora1.down`), and DoRA's magnitudes in either naming. This module reads names
only, so the operator refuses at staging what the server would refuse at load, with the same
words: every refusal names the format and says what to do instead. Served formats are converted
to plain LoRA pairs by the server (`lora_inference.formats`), or, for those whose delta is not
low rank (`Format.merged_only`: LoKr with a full w2, `.diff` files, kohya / LyCORIS DoRA), to
whole per-layer deltas merged for batches of that adapter alone (`lora_inference.merge_only`);
this module imports no torch.

docs/adapters.md lists the formats, and the test that proves each.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from lora_volume import errors


@dataclass(frozen=True)
class Format:
    """One adapter format: `key` for machines, `label` for people. `merged_only`: its delta is
    not low rank, so the server merges it into the base weights for batches of it alone."""

    key: str
    label: str
    merged_only: bool = False


# Served exactly, as low-rank pairs.
LORA = Format("lora", "LoRA")
LOCON = Format("locon", "LyCORIS LoCon (Tucker)")
LOHA = Format("loha", "LyCORIS LoHa")
LOKR = Format("lokr", "LyCORIS LoKr")
XLABS = Format("xlabs", "XLabs Flux LoRA")
LORA_BIAS = Format("lora_bias", "LoRA with biases")
DORA = Format("dora", "DoRA (peft)")
# Served exactly, merged only: whole-matrix deltas, merged into the base weights for a batch of
# that adapter alone (docs/adapters.md, "Served merged only").
LOKR_FULL = Format("lokr_full", "LyCORIS LoKr with a full w2", merged_only=True)
FULL = Format("full", "full weight differences (.diff / .diff_b)", merged_only=True)
DORA_KOHYA = Format("dora_kohya", "kohya / LyCORIS DoRA (dora_scale)", merged_only=True)
SERVED = (LORA, LOCON, LOHA, LOKR, XLABS, LORA_BIAS, DORA, LOKR_FULL, FULL, DORA_KOHYA)

# A tensor name's role, by the part after its module path. Order matters: the first match wins.
_ROLES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (role, re.compile(pattern))
    for role, pattern in (
        ("dora", r"\.lora_magnitude_vector(\.weight)?$"),
        ("dora_scale", r"(^|[._])dora_scale([._]|$)"),
        ("bias", r"\.lora_B\.bias$"),
        ("kohya_bias", r"\.lora_up\.bias$"),
        ("diff", r"\.diff(_b)?$"),
        ("oft", r"\.(oft_blocks|oft_diag|oft_r|oft_R|boft_R|boft_s|oft_s|rescale)(\.weight)?$"),
        ("glora", r"\.(a1|a2|b1|b2)\.weight$"),
        ("ia3", r"\.(ia3_l\.[^.]+\.weight|ia3_l|on_input)$|\.ia3_l\."),
        ("norm", r"\.(w_norm|b_norm)$"),
        ("loha_tucker", r"\.hada_t[12]$"),
        ("loha", r"\.hada_w[12]_[ab]$"),
        ("lokr_tucker", r"\.lokr_t[12]$"),
        ("lokr_full_w2", r"\.lokr_w2$"),
        ("lokr", r"\.lokr_w[12](_[ab])?$"),
        ("locon_mid", r"\.lora_mid\.weight$"),
        (
            "xlabs",
            r"^(diffusion_model\.)?(double|single)_blocks\.\d+\.processor\..*\.(down|up)\.weight$",
        ),
        (
            "pair",
            r"(lora_A|lora_B|lora_down|lora_up|lora\.down|lora\.up|lora_linear_layer\.down"
            r"|lora_linear_layer\.up)\.weight$"
            r"|(lora_A|lora_B|lora_down|lora_up)\.[^.]+\.weight$|\.alpha$",
        ),
    )
)

# Refused by name: what each one is, and what to do instead.
_REFUSED = {
    "kohya_bias": (
        "kohya-named LoRA with biases (lora_up.bias)",
        "biases are served in peft's naming only (lora_B.bias); save the adapter with peft, "
        "or re-export it without the bias tensors",
    ),
    "oft": (
        "OFT / BOFT (orthogonal finetuning)",
        "it rotates the base weights and is not a low-rank delta; OFT is not supported, "
        "extract a LoRA from the merged model instead",
    ),
    "glora": (
        "GLoRA",
        "GLoRA is not supported; extract a LoRA from the merged model instead",
    ),
    "ia3": (
        "(IA)3",
        "(IA)3 rescales activations rather than adding to weights and is not supported; "
        "extract a LoRA from the merged model instead",
    ),
    "norm": (
        "LyCORIS trained norms (w_norm / b_norm)",
        "norm-layer training is not served; re-export the adapter without train_norm",
    ),
    "loha_tucker": (
        "LyCORIS LoHa with Tucker cores (hada_t1 / hada_t2)",
        "only LoHa without use_tucker is served; re-train without use_tucker",
    ),
    "lokr_tucker": (
        "LyCORIS LoKr with a Tucker core (lokr_t2)",
        "only LoKr without use_tucker is served; re-train without use_tucker",
    ),
}
_SERVED_BY_ROLE = {
    "dora_scale": DORA_KOHYA,
    "diff": FULL,
    "lokr_full_w2": LOKR_FULL,
    "loha": LOHA,
    "lokr": LOKR,
    "locon_mid": LOCON,
    "xlabs": XLABS,
    "bias": LORA_BIAS,
    "dora": DORA,
}


def merged_only(key: str) -> bool:
    """Whether the format keyed `key` (`Format.key`, as records carry it) is served merged only."""
    return any(f.key == key and f.merged_only for f in SERVED)


def stackable(key: str) -> bool:
    """Whether an adapter of the format keyed `key` may be a member of a stack (a request's
    `lora` list or block weights, a LoRAAdapter's `spec.compose`): a stack is a sum of low-rank
    deltas, and neither a merged-only delta nor DoRA's rescale of the weights is one."""
    return not merged_only(key) and key != DORA.key


def role(key: str) -> str | None:
    """The role of one tensor name (None: not part of any adapter format known here)."""
    for name, pattern in _ROLES:
        if pattern.search(key):
            return name
    return None


def classify(keys: Iterable[str], *, name: str = "adapter") -> Format:
    """The format of a file whose tensors are named `keys`, or InvalidAdapter naming why not.

    A file that mixes served formats (LoCon layers beside LoHa ones, as LyCORIS writes when
    some layers are convolutions) is named by the least plain of them.
    """
    keys = list(keys)
    if not keys:
        raise errors.InvalidAdapter(f"{name} holds no tensors")
    roles: dict[str | None, str] = {}
    for key in keys:
        roles.setdefault(role(key), key)
    for refused, (label, what_to_do) in _REFUSED.items():
        if refused in roles:
            raise errors.InvalidAdapter(
                f"{name} is a {label} file (tensor {roles[refused]!r}): {what_to_do}"
            )
    if None in roles:
        raise errors.InvalidAdapter(
            f"{name}: tensor {roles[None]!r} is not part of a LoRA or of any adapter format the "
            "server knows (LoRA, LoCon, LoHa, LoKr, XLabs); is this a full checkpoint rather "
            "than an adapter?"
        )
    for served in (
        "dora_scale",
        "diff",
        "lokr_full_w2",
        "dora",
        "lokr",
        "loha",
        "locon_mid",
        "xlabs",
        "bias",
    ):
        if served in roles:
            return _SERVED_BY_ROLE[served]
    return LORA
