"""What a LoRAAdapter's status says of its file: format, declared rank, target components and
trigger words, from the header alone, in every naming the trainers write (pure)."""

from __future__ import annotations

import json

import pytest
from lora_volume import description, errors, files, formats

Shapes = dict[str, tuple[int, ...]]


def header(shapes: Shapes, metadata: dict[str, str] | None = None) -> files.SafetensorsHeader:
    """A header as `files.read_safetensors_header` parses it (the offsets play no part here)."""
    return files.SafetensorsHeader(
        tensors={k: files.TensorEntry("F32", s, 0, 0) for k, s in shapes.items()},
        metadata=metadata or {},
    )


def pair(stem: str, rank: int, *, down: str, up: str, fan: int = 32) -> Shapes:
    return {f"{stem}.{down}": (rank, fan), f"{stem}.{up}": (fan, rank)}


def kohya(stem: str, rank: int) -> Shapes:
    return {**pair(stem, rank, down="lora_down.weight", up="lora_up.weight"), f"{stem}.alpha": ()}


def peft(stem: str, rank: int) -> Shapes:
    return pair(stem, rank, down="lora_A.weight", up="lora_B.weight")


def loha(stem: str, rank: int) -> Shapes:
    return {
        **{f"{stem}.hada_w{i}_a": (32, rank) for i in (1, 2)},
        **{f"{stem}.hada_w{i}_b": (rank, 16) for i in (1, 2)},
        f"{stem}.alpha": (),
    }


def lokr(stem: str, rank: int) -> Shapes:
    # A full w1 (4 x 2) is not a low-rank factor: its size is no rank.
    return {
        f"{stem}.lokr_w1": (4, 2),
        f"{stem}.lokr_w2_a": (8, rank),
        f"{stem}.lokr_w2_b": (rank, 8),
    }


CASES = [
    pytest.param(
        {**peft("unet.down_blocks.0.attn.to_q", 4), **peft("text_encoder.layers.0.q_proj", 8)},
        ("lora", 8, ("text_encoder", "unet")),
        id="peft-sd",
    ),
    pytest.param(
        {
            **kohya("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q", 16),
            **kohya("lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 4),
            **kohya("lora_te2_text_model_encoder_layers_0_self_attn_q_proj", 4),
        },
        ("lora", 16, ("text_encoder", "text_encoder_2", "unet")),
        id="kohya-sdxl",
    ),
    pytest.param(
        {**kohya("lora_unet_input_blocks_4_1_proj_in", 8), **kohya("lora_te_text_model_x", 2)},
        ("lora", 8, ("text_encoder", "unet")),
        id="kohya-sd15-sgm-names",
    ),
    pytest.param(
        {
            **kohya("lora_unet_double_blocks_0_img_attn_qkv", 16),
            **kohya("lora_unet_final_layer_linear", 16),
            **kohya("lora_te1_text_model_encoder_layers_0_mlp_fc1", 4),
        },
        ("lora", 16, ("text_encoder", "transformer")),
        id="kohya-flux",
    ),
    pytest.param(
        kohya("lora_unet_joint_blocks_0_x_block_attn_qkv", 8),
        ("lora", 8, ("transformer",)),
        id="kohya-sd3",
    ),
    pytest.param(
        kohya("lora_transformer_single_transformer_blocks_0_proj_out", 4),
        ("lora", 4, ("transformer",)),
        id="kohya-transformer-prefix",
    ),
    pytest.param(
        {**peft("transformer.transformer_blocks.0.attn.to_q", 32)},
        ("lora", 32, ("transformer",)),
        id="peft-flux",
    ),
    pytest.param(
        pair(
            "double_blocks.0.processor.qkv_lora1",
            4,
            down="down.weight",
            up="up.weight",
        ),
        ("xlabs", 4, ("transformer",)),
        id="xlabs",
    ),
    pytest.param(
        pair(
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj",
            6,
            down="lora_linear_layer.down.weight",
            up="lora_linear_layer.up.weight",
        ),
        ("lora", 6, ("text_encoder",)),
        id="old-diffusers",
    ),
    pytest.param(
        pair("down_blocks.0.attn.processor.to_q_lora", 4, down="down.weight", up="up.weight"),
        ("lora", 4, ("unet",)),
        id="attn-procs-without-a-component",
    ),
    pytest.param(
        {
            **kohya("lora_unet_down_blocks_0_resnets_0_conv1", 8),
            "lora_unet_down_blocks_0_resnets_0_conv1.lora_mid.weight": (8, 8, 3, 3),
        },
        ("locon", 8, ("unet",)),
        id="locon-tucker",
    ),
    pytest.param(
        loha("lora_unet_mid_block_attentions_0_proj_in", 3), ("loha", 3, ("unet",)), id="loha"
    ),
    pytest.param(
        {**lokr("lora_unet_up_blocks_0_attentions_0_proj_in", 2), **kohya("lora_te_x_q_proj", 1)},
        ("lokr", 2, ("text_encoder", "unet")),
        id="lokr",
    ),
    pytest.param(
        {
            **peft("unet.a.to_q", 4),
            "unet.a.to_q.lora_magnitude_vector": (32,),
            "unet.a.to_k.lora_B.bias": (32,),
        },
        ("dora", 4, ("unet",)),
        id="peft-dora",
    ),
    pytest.param(
        {
            "unet.a.to_q.lora_A.default.weight": (12, 32, 3, 3),
            "unet.a.to_q.lora_B.default.weight": (32, 12, 1, 1),
        },
        ("lora", 12, ("unet",)),
        id="peft-conv-with-adapter-name",
    ),
]


@pytest.mark.parametrize(("shapes", "expected"), CASES)
def test_a_file_is_described_by_its_format_declared_rank_and_components(
    shapes: Shapes, expected: tuple[str, int, tuple[str, ...]]
) -> None:
    described = description.describe(header(shapes))
    assert (described.format.key, described.rank, described.targets) == expected
    assert described.format == files.check_lora_keys(list(shapes))  # the staging check's word


def test_the_trigger_words_are_the_files_own() -> None:
    tags = {"10_x": {"lighthouse": 3, "cliff": 5}}
    metadata = {"modelspec.trigger_phrase": "lhstyle", "ss_tag_frequency": json.dumps(tags)}
    described = description.describe(header(peft("unet.a", 4), metadata))
    assert described.trigger_words == ("lhstyle", "cliff", "lighthouse")


def test_a_trigger_word_too_long_to_be_one_is_left_out() -> None:
    """A status stays small whatever a file's metadata holds."""
    long = "x" * (description.MAX_WORD_CHARS + 1)
    metadata = {"modelspec.trigger_phrase": f"short, {long}"}
    assert description.describe(header(peft("unet.a", 4), metadata)).trigger_words == ("short",)


def test_a_refused_format_is_refused_as_staging_refuses_it() -> None:
    with pytest.raises(errors.InvalidAdapter, match="OFT"):
        description.describe(header({**kohya("lora_unet_a", 4), "lora_unet_a.oft_blocks": (4, 4)}))


def test_whole_matrices_declare_no_rank() -> None:
    """Full weight differences and a LoKr's full factor are no low-rank factors: a file of
    them alone declares rank 0."""
    shapes: Shapes = {
        "lora_unet_a.diff": (32, 32),
        "lora_unet_b.lokr_w1": (4, 2),
        "lora_unet_b.lokr_w2": (8, 8),
    }
    assert description.declared_rank(header(shapes)) == 0


def test_a_stack_sums_its_members_ranks_and_unites_their_targets_and_words() -> None:
    a = description.Description(formats.LOHA, 3, ("unet",), ("pixel", "8bit"))
    b = description.Description(formats.LORA, 16, ("text_encoder", "unet"), ("8bit", "retro"))
    stack = description.stacked([a, b])
    assert stack == description.Description(
        description.STACK, 19, ("text_encoder", "unet"), ("pixel", "8bit", "retro")
    )


@pytest.mark.parametrize("fmt", [*formats.SERVED, description.STACK], ids=lambda f: f.key)
def test_a_format_key_names_its_format_again(fmt: formats.Format) -> None:
    assert description.format_by_key(fmt.key) == fmt


def test_an_unknown_format_key_names_itself() -> None:
    assert description.format_by_key("future").label == "future"
