"""Request parsing (pure): every malformed body gets a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from lora_inference import api, errors

DEFAULTS: dict[str, Any] = {
    "base_model": "base",
    "default_size": 32,
    "default_steps": 30,
    "default_guidance": 7.5,
}


def parse(body: Any) -> Any:
    return api.parse_generation(body, **DEFAULTS)


def test_defaults_fill_in() -> None:
    params, choice = parse({"prompt": "x"})
    assert (params.n, params.width, params.height, params.steps, params.guidance_scale) == (
        1,
        32,
        32,
        30,
        7.5,
    )
    assert choice.name is None and params.seed is None


def test_model_naming_an_adapter_selects_it() -> None:
    _, choice = parse({"prompt": "x", "model": "pixel"})
    assert (choice.name, choice.param) == ("pixel", "model")


def test_base_model_name_means_no_adapter() -> None:
    _, choice = parse({"prompt": "x", "model": "base"})
    assert choice.name is None


def test_lora_object_selects_adapter_scale_and_path() -> None:
    params, choice = parse(
        {"prompt": "x", "lora": {"name": "p", "scale": -1.5, "local_path": "/a/p"}}
    )
    assert (choice.name, choice.local_path, params.scale) == ("p", "/a/p", -1.5)


def test_a_lora_list_stacks_adapters_each_at_its_scale() -> None:
    params, choice = parse(
        {"prompt": "x", "model": "base", "lora": [{"name": "b", "scale": 0.5}, {"name": "a"}]}
    )
    assert choice.name is None and params.scale is None
    assert choice.stack == (api.StackMember("b", 0.5), api.StackMember("a", None))


def test_a_lora_list_of_one_is_the_object_form() -> None:
    params, choice = parse({"prompt": "x", "lora": [{"name": "a", "scale": 0.3}]})
    assert (choice.name, choice.stack, params.scale) == ("a", (), 0.3)


def test_no_scale_means_the_adapters_default() -> None:
    assert parse({"prompt": "x", "model": "p"})[0].scale is None
    assert parse({"prompt": "x", "lora": {"name": "p"}})[0].scale is None


def test_load_scale_defaults_to_one_and_is_bounded() -> None:
    assert api.parse_load({"lora_name": "a", "lora_path": "/p"}).scale == 1.0
    assert api.parse_load({"lora_name": "a", "lora_path": "/p", "scale": -2}).scale == -2.0
    with pytest.raises(errors.InvalidRequest) as e:
        api.parse_load({"lora_name": "a", "lora_path": "/p", "scale": 11})
    assert e.value.param == "scale"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param([], None, id="not-object"),
        pytest.param({}, "prompt", id="missing-prompt"),
        pytest.param({"prompt": ""}, "prompt", id="empty-prompt"),
        pytest.param({"prompt": 3}, "prompt", id="prompt-type"),
        pytest.param({"prompt": "x" * 5000}, "prompt", id="prompt-too-long"),
        pytest.param({"prompt": "x", "n": 0}, "n", id="n-zero"),
        pytest.param({"prompt": "x", "n": 1000}, "n", id="n-absurd"),
        pytest.param({"prompt": "x", "n": "2"}, "n", id="n-type"),
        pytest.param({"prompt": "x", "n": 1.5}, "n", id="n-float"),
        pytest.param({"prompt": "x", "n": True}, "n", id="n-bool"),
        pytest.param({"prompt": "x", "size": "big"}, "size", id="size-format"),
        pytest.param({"prompt": "x", "size": "100000x100000"}, "size", id="size-absurd"),
        pytest.param({"prompt": "x", "size": "33x32"}, "size", id="size-not-multiple-of-8"),
        pytest.param(
            {"prompt": "x", "num_inference_steps": 100000}, "num_inference_steps", id="steps"
        ),
        pytest.param(
            {"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale", id="guidance-nan"
        ),
        pytest.param({"prompt": "x", "seed": -1}, "seed", id="seed-negative"),
        pytest.param({"prompt": "x", "response_format": "url"}, "response_format", id="url-format"),
        pytest.param({"prompt": "x", "model": 5}, "model", id="model-type"),
        pytest.param({"prompt": "x", "lora": "p"}, "lora", id="lora-type"),
        pytest.param({"prompt": "x", "lora": {"scale": 1}}, "lora.name", id="lora-no-name"),
        pytest.param(
            {"prompt": "x", "lora": {"name": "p", "scale": 99}}, "lora.scale", id="scale-range"
        ),
        pytest.param({"prompt": "x", "lora": []}, "lora", id="stack-empty"),
        pytest.param(
            {"prompt": "x", "lora": [{"name": f"a{i}"} for i in range(api.MAX_STACK + 1)]},
            "lora",
            id="stack-too-long",
        ),
        pytest.param({"prompt": "x", "lora": [{"name": "a"}, "b"]}, "lora[1]", id="stack-entry"),
        pytest.param(
            {"prompt": "x", "lora": [{"name": "a"}, {"name": "b", "local_path": "/b"}]},
            "lora[1]",
            id="stack-path",
        ),
        pytest.param(
            {"prompt": "x", "lora": [{"name": "a"}, {"name": "b", "scale": "1"}]},
            "lora[1].scale",
            id="stack-scale",
        ),
        pytest.param(
            {"prompt": "x", "lora": [{"name": "a"}, {"scale": 1}]}, "lora[1].name", id="stack-name"
        ),
        pytest.param(
            {"prompt": "x", "lora": [{"name": "a"}, {"name": "a"}]}, "lora", id="stack-twice"
        ),
        pytest.param(
            {"prompt": "x", "model": "a", "lora": [{"name": "a"}, {"name": "b"}]},
            "model",
            id="stack-and-model",
        ),
        pytest.param(
            {"prompt": "x", "lora": {"name": "p", "weight": 1}}, "lora", id="lora-unknown"
        ),
        pytest.param(
            {"prompt": "x", "model": "a", "lora": {"name": "b"}}, "model", id="two-adapters"
        ),
    ],
)
def test_malformed_generation_bodies(body: Any, param: str | None) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        parse(body)
    assert caught.value.param == param


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"lora_name": "a"},
        {"lora_path": "/x"},
        {"lora_name": 1, "lora_path": "/x"},
        {"lora_name": "a", "lora_path": "/x", "pinned": "yes"},
    ],
)
def test_malformed_load_bodies(body: dict[str, Any]) -> None:
    with pytest.raises(errors.InvalidRequest):
        api.parse_load(body)
