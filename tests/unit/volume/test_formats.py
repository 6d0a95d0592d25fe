"""Every adapter format is recognised by its tensor names: served ones by name, the rest refused
with the format's name and what to do, at staging as at load (the same pure check)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from lora_operator.store import publishing
from lora_volume import errors, formats
from safetensors.numpy import save_file

PAIR = ["lora_unet_a_to_q.lora_down.weight", "lora_unet_a_to_q.lora_up.weight"]

SERVED = [
    pytest.param(["unet.a.to_q.lora_A.weight", "unet.a.to_q.lora_B.weight"], "lora", id="peft"),
    pytest.param([*PAIR, "lora_unet_a_to_q.alpha"], "lora", id="kohya"),
    pytest.param(
        [
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_linear_layer.down.weight",
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_linear_layer.up.weight",
        ],
        "lora",
        id="old-diffusers",
    ),
    pytest.param(["unet.a.processor.to_q_lora.down.weight"], "lora", id="attn-procs"),
    pytest.param(
        ["unet.a.to_q.lora_A.weight", "unet.a.to_q.lora_B.weight", "unet.a.to_q.lora_B.bias"],
        "lora_bias",
        id="peft-lora-bias",
    ),
    pytest.param(
        [
            "unet.a.to_q.lora_A.weight",
            "unet.a.to_q.lora_B.weight",
            "unet.a.to_q.lora_magnitude_vector",
        ],
        "dora",
        id="peft-dora",
    ),
    pytest.param(
        [*PAIR, "lora_unet_b_conv.lora_mid.weight", "lora_unet_b_conv.alpha"],
        "locon",
        id="locon-tucker",
    ),
    pytest.param(
        [f"lora_unet_a.hada_w{i}_{ab}" for i in (1, 2) for ab in "ab"] + ["lora_unet_a.alpha"],
        "loha",
        id="loha",
    ),
    pytest.param(
        ["lora_unet_a.lokr_w1", "lora_unet_a.lokr_w2_a", "lora_unet_a.lokr_w2_b", *PAIR],
        "lokr",
        id="lokr-factored-w2",
    ),
    pytest.param(
        [
            "double_blocks.0.processor.qkv_lora1.down.weight",
            "double_blocks.0.processor.qkv_lora1.up.weight",
            "single_blocks.1.processor.proj_lora.down.weight",
        ],
        "xlabs",
        id="xlabs",
    ),
    pytest.param(
        ["lora_unet_a.lokr_w1", "lora_unet_a.lokr_w2", "lora_unet_a.alpha"],
        "lokr_full",
        id="lokr-full-w2",
    ),
    pytest.param(
        [
            *("lora_unet_b.lokr_w1", "lora_unet_b.lokr_w2_a", "lora_unet_b.lokr_w2_b"),
            *("lora_unet_a.lokr_w1", "lora_unet_a.lokr_w2"),
        ],
        "lokr_full",
        id="lokr-mixed-full-and-factored-w2",
    ),
    pytest.param(["lora_unet_a.diff", "lora_unet_a.diff_b"], "full", id="diff"),
    pytest.param([*PAIR, "lora_unet_b.diff"], "full", id="diff-beside-pairs"),
    pytest.param([*PAIR, "lora_unet_a_to_q.dora_scale"], "dora_kohya", id="dora-kohya"),
    pytest.param(
        [f"lora_unet_a.hada_w{i}_{ab}" for i in (1, 2) for ab in "ab"] + ["lora_unet_a.dora_scale"],
        "dora_kohya",
        id="dora-kohya-loha",
    ),
]
MERGED_ONLY = {"lokr_full", "full", "dora_kohya"}

REFUSED = [
    pytest.param("lora_unet_a_to_q.lora_up.bias", "kohya-named LoRA with biases", id="kohya-bias"),
    pytest.param("lora_unet_a.oft_blocks", "OFT", id="oft-lycoris"),
    pytest.param("unet.a.oft_r", "OFT", id="oft-peft"),
    pytest.param("lora_unet_a.a1.weight", "GLoRA", id="glora"),
    pytest.param("lora_unet_a.on_input", "(IA)3", id="ia3-lycoris"),
    pytest.param("unet.a.ia3_l", "(IA)3", id="ia3-peft"),
    pytest.param("lora_unet_a.w_norm", "trained norms", id="norm"),
    pytest.param("lora_unet_a.hada_t1", "LoHa with Tucker", id="loha-tucker"),
    pytest.param("lora_unet_a.lokr_t2", "LoKr with a Tucker", id="lokr-tucker"),
]


@pytest.mark.parametrize(("keys", "key"), SERVED)
def test_served_formats_are_named(keys: list[str], key: str) -> None:
    assert formats.classify(keys).key == key
    assert formats.merged_only(key) == (key in MERGED_ONLY)


@pytest.mark.parametrize(("keys", "key"), SERVED)
def test_staging_accepts_each_served_format_merged_only_ones_included(
    keys: list[str], key: str, tmp_path: Path
) -> None:
    """The operator stages what the server serves: a merged-only file (LoKr with a full w2,
    `.diff`) is staged like any other."""
    path = tmp_path / "adapter.safetensors"
    save_file({k: np.zeros((2, 2), np.float32) for k in keys}, str(path))
    assert publishing.describe_file(path, "source x").format.key == key


@pytest.mark.parametrize(("tensor", "label"), REFUSED)
def test_refused_formats_are_refused_by_name_with_what_to_do(tensor: str, label: str) -> None:
    with pytest.raises(errors.InvalidAdapter) as raised:
        formats.classify([*PAIR, tensor], name="my-adapter")
    message = raised.value.message
    assert label in message and "my-adapter" in message and tensor in message
    assert "not part of a LoRA" not in message  # the old catch-all, which named nothing


def test_a_named_format_wins_over_an_unknown_tensor_beside_it() -> None:
    """LyCORIS (IA)3 writes `.weight` beside `.on_input`: the file is named (IA)3, not called a
    checkpoint."""
    with pytest.raises(errors.InvalidAdapter, match=r"\(IA\)3"):
        formats.classify(["lora_unet_a.weight", "lora_unet_a.on_input"])


def test_a_full_checkpoint_is_still_called_one() -> None:
    with pytest.raises(errors.InvalidAdapter, match="full checkpoint"):
        formats.classify([*PAIR, "model.diffusion_model.input_blocks.0.0.weight"])


@pytest.mark.parametrize(("tensor", "label"), REFUSED)
def test_staging_refuses_each_format_with_the_same_reason(
    tensor: str, label: str, tmp_path: Path
) -> None:
    """The operator's staging check (its reason becomes the LoRAAdapter's Failed status) reads
    the header only and names the format as the server does."""
    path = tmp_path / "adapter.safetensors"
    save_file({k: np.zeros((2, 2), np.float32) for k in (*PAIR, tensor)}, str(path))
    with pytest.raises(errors.InvalidAdapter, match=label.replace("(", r"\(").replace(")", r"\)")):
        publishing.describe_file(path, "source x")
