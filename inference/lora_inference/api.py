"""The HTTP API's request shapes: parsing and checking bodies (pure; no aiohttp, no torch).

Shapes follow vLLM (adapter endpoints) and OpenAI Images (generation), so the official `openai`
client and an operator written for vLLM both work against this server.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from lora_volume import stacks

from lora_inference import errors

MAX_IMAGES = 10
MAX_STEPS = 200
MAX_SIDE = 2048
MAX_PROMPT_CHARS = 4000
SCALE_RANGE = stacks.SCALE_RANGE
MAX_STACK = stacks.MAX_MEMBERS  # adapters one request may stack (`lora` as a list)
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


@dataclass(frozen=True)
class GenerationParams:
    """A validated generation request (`parse_generation`), as the engine takes it."""

    prompt: str
    negative_prompt: str | None
    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int | None
    scale: float | None  # None: the adapter's default scale (its load call's `scale`)


@dataclass(frozen=True)
class LoadAdapterRequest:
    name: str
    path: str
    load_inplace: bool
    pinned: bool
    scale: float


@dataclass(frozen=True)
class StackMember:
    """One adapter of a stacked request (`lora: [...]`) and its weight (None: its default),
    varied per block group by `blocks` (stackkeys)."""

    name: str
    scale: float | None
    blocks: stacks.Blocks = ()


@dataclass(frozen=True)
class AdapterChoice:
    """Which adapter a generation request asked for (None: the base model), or which stack."""

    name: str | None
    local_path: str | None
    param: str
    # Two or more adapters applied together (`lora` as a list); `name` is None then.
    stack: tuple[StackMember, ...] = ()


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise errors.InvalidRequest("the request body must be a JSON object")
    return body


def _optional_string(body: dict[str, Any], field: str, *, param: str | None = None) -> str | None:
    value = body.get(field)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise errors.InvalidRequest(
            f"'{param or field}' must be a non-empty string", param=param or field
        )
    return value


def _string(body: dict[str, Any], field: str, *, param: str | None = None) -> str:
    value = _optional_string(body, field, param=param)
    if value is None:
        raise errors.InvalidRequest(f"'{param or field}' is required", param=param or field)
    return value


def _bool(body: dict[str, Any], field: str) -> bool:
    value = body.get(field, False)
    if not isinstance(value, bool):
        raise errors.InvalidRequest(f"'{field}' must be true or false", param=field)
    return value


def _number(
    body: dict[str, Any],
    field: str,
    default: float,
    low: float,
    high: float,
    *,
    integer: bool = False,
    param: str | None = None,
) -> float:
    param = param or field
    value = body.get(field, default)
    if value is None:
        value = default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
    ):
        kind = "an integer" if integer else "a number"
        raise errors.InvalidRequest(f"'{param}' must be {kind}", param=param)
    if not math.isfinite(value) or not low <= value <= high:
        raise errors.InvalidRequest(
            f"'{param}' must be between {low:g} and {high:g}, got {value}", param=param
        )
    return value


def parse_load(body: Any) -> LoadAdapterRequest:
    body = _require_object(body)
    return LoadAdapterRequest(
        name=_string(body, "lora_name"),
        path=_string(body, "lora_path"),
        load_inplace=_bool(body, "load_inplace"),
        pinned=_bool(body, "pinned"),
        scale=float(_number(body, "scale", 1.0, *SCALE_RANGE)),
    )


def parse_unload(body: Any) -> str:
    body = _require_object(body)
    return _string(body, "lora_name")


def parse_size(value: Any, default: int) -> tuple[int, int]:
    if value is None or value == "auto":
        return default, default
    if not isinstance(value, str) or not (m := _SIZE.fullmatch(value)):
        raise errors.InvalidRequest("'size' must look like '1024x1024'", param="size")
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if not 8 <= side <= MAX_SIDE or side % 8:
            raise errors.InvalidRequest(
                f"'size' sides must be multiples of 8 between 8 and {MAX_SIDE}, got {value}",
                param="size",
            )
    return width, height


def parse_generation(
    body: Any, *, base_model: str, default_size: int, default_steps: int, default_guidance: float
) -> tuple[GenerationParams, AdapterChoice]:
    body = _require_object(body)
    prompt = _string(body, "prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise errors.InvalidRequest(
            f"'prompt' is longer than {MAX_PROMPT_CHARS} characters", param="prompt"
        )
    negative = _optional_string(body, "negative_prompt")
    fmt = body.get("response_format", "b64_json")
    if fmt not in (None, "b64_json"):
        raise errors.InvalidRequest(
            "only response_format 'b64_json' is supported: "
            "this server keeps no image store for URLs",
            param="response_format",
        )
    n = int(_number(body, "n", 1, 1, MAX_IMAGES, integer=True))
    width, height = parse_size(body.get("size"), default_size)
    steps = int(_number(body, "num_inference_steps", default_steps, 1, MAX_STEPS, integer=True))
    guidance = float(_number(body, "guidance_scale", default_guidance, 0.0, 50.0))
    seed_value = body.get("seed")
    seed = None if seed_value is None else int(_number(body, "seed", 0, 0, 2**31 - 1, integer=True))
    choice, scale = _adapter_choice(body, base_model)
    params = GenerationParams(
        prompt=prompt,
        negative_prompt=negative,
        n=n,
        width=width,
        height=height,
        steps=steps,
        guidance_scale=guidance,
        seed=seed,
        scale=scale,
    )
    return params, choice


def _adapter_choice(body: dict[str, Any], base_model: str) -> tuple[AdapterChoice, float | None]:
    """The adapter asked for and its scale; None: the adapter's own default (set at load)."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise errors.InvalidRequest("'model' must be a non-empty string", param="model")
    lora = body.get("lora")
    if lora is None:
        name = None if model in (None, base_model) else model
        return AdapterChoice(name=name, local_path=None, param="model"), None
    if isinstance(lora, list):
        return _stack_choice(lora, model, base_model)
    if not isinstance(lora, dict):
        raise errors.InvalidRequest(
            "'lora' must be an object with 'name' and optional 'scale', or a list of them",
            param="lora",
        )
    unknown = set(lora) - {"name", "scale", "local_path", "blocks"}
    if unknown:
        raise errors.InvalidRequest(
            f"unknown field(s) in 'lora': {', '.join(sorted(unknown))}", param="lora"
        )
    name = _string(lora, "name", param="lora.name")
    scale = _optional_scale(lora, "lora.scale")
    local_path = _optional_string(lora, "local_path", param="lora.local_path")
    blocks = _blocks(lora, "lora.blocks")
    if model not in (None, base_model, name):
        raise errors.InvalidRequest(
            f"'model' names {model!r} but 'lora.name' names {name!r}; name one adapter",
            param="model",
        )
    if blocks:
        if local_path is not None:
            raise errors.InvalidRequest(
                "'lora.blocks' scales a registered adapter: load it first, then name it",
                param="lora.blocks",
            )
        member = StackMember(name=name, scale=scale, blocks=blocks)
        return AdapterChoice(name=None, local_path=None, param="lora", stack=(member,)), None
    return AdapterChoice(name=name, local_path=local_path, param="lora.name"), scale


def _stack_choice(
    lora: list[Any], model: Any, base_model: str
) -> tuple[AdapterChoice, float | None]:
    """`lora` as a list: adapters applied together, each at its own scale. A list of one is
    the same request as the object form."""
    if not 1 <= len(lora) <= MAX_STACK:
        raise errors.InvalidRequest(
            f"'lora' may stack 1 to {MAX_STACK} adapters, got {len(lora)}", param="lora"
        )
    members = []
    for i, entry in enumerate(lora):
        param = f"lora[{i}]"
        if not isinstance(entry, dict):
            raise errors.InvalidRequest(
                f"'{param}' must be an object with 'name' and optional 'scale'", param=param
            )
        unknown = set(entry) - {"name", "scale", "blocks"}
        if unknown:
            raise errors.InvalidRequest(
                f"unknown field(s) in '{param}': {', '.join(sorted(unknown))} (a stacked "
                "adapter is named, never given by path: register it first)",
                param=param,
            )
        name = _string(entry, "name", param=f"{param}.name")
        members.append(
            StackMember(
                name=name,
                scale=_optional_scale(entry, f"{param}.scale"),
                blocks=_blocks(entry, f"{param}.blocks"),
            )
        )
    names = [m.name for m in members]
    if len(set(names)) < len(names):
        raise errors.InvalidRequest(
            f"'lora' names an adapter twice ({', '.join(names)}); give each once with the sum "
            "of its scales",
            param="lora",
        )
    if model not in (None, base_model):
        raise errors.InvalidRequest(
            f"'model' names {model!r} while 'lora' stacks adapters; leave 'model' out or name "
            "the base model",
            param="model",
        )
    if len(members) == 1 and not members[0].blocks:
        choice = AdapterChoice(name=names[0], local_path=None, param="lora[0].name")
        return choice, members[0].scale
    return AdapterChoice(name=None, local_path=None, param="lora", stack=tuple(members)), None


def _blocks(body: dict[str, Any], param: str) -> stacks.Blocks:
    """`blocks`: {group: multiplier} for some of stackkeys.BLOCK_GROUPS; () when absent."""
    given = body.get("blocks")
    if given is None:
        return ()
    if not isinstance(given, dict) or not given:
        raise errors.InvalidRequest(
            f"'{param}' must be an object of block groups and scales, e.g. "
            '{"down": 0.5, "up": 0}',
            param=param,
        )
    unknown = sorted(set(given) - set(stacks.BLOCK_GROUPS))
    if unknown:
        raise errors.InvalidRequest(
            f"unknown block group(s) in '{param}': {', '.join(unknown)}; the groups are "
            f"{', '.join(stacks.BLOCK_GROUPS)}",
            param=param,
        )
    return tuple(
        (group, float(_number(given, group, 1.0, *SCALE_RANGE, param=f"{param}.{group}")))
        for group in stacks.BLOCK_GROUPS
        if group in given
    )


def _optional_scale(body: dict[str, Any], param: str) -> float | None:
    if body.get("scale") is None:
        return None
    return float(_number(body, "scale", 1.0, *SCALE_RANGE, param=param))
