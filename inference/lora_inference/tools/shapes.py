"""A small text-to-image model that draws something, and adapters that visibly change it.

Random weights draw noise, so a demo of them cannot show what an adapter does. This module
trains, on a CPU, an SD 1.5-family pipeline (the same classes as Stable Diffusion
1.5: a CLIP text encoder, a UNet with cross-attention, a KL autoencoder, SD 1.5's noise schedule)
on a procedurally drawn data set: one shape (circle, square, triangle) in one colour (red, green,
blue, yellow) on paper, captioned "a red circle". Each adapter is a LoRA of the UNet trained on
the same captions drawn in another way:

- `pixel-art` (a texture): the shape drawn on an 8x8 grid of square pixels;
- `palette-swap` (a palette): red drawn green, green blue, blue yellow, yellow red;
- `shape-shift` (a shape): circles drawn as squares, squares as triangles, triangles as circles.

The weights the demo and the playground use are committed under `models/shapes/` (a few MB);
`lora-inference train-shapes models/shapes` makes them again (about 40 minutes on 2 cores).
Tests keep their tiny random pipelines; this module only builds models and data, it never
serves them.
"""

from __future__ import annotations

import dataclasses
import json
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from lora_inference.tools import tiny_models

SIZE = 32  # pixels; the autoencoder halves it, so the UNet works on 16x16 latents
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
PAPER = (245, 242, 235)
STYLES = ("plain", "pixel-art", "palette-swap", "shape-shift")
ADAPTERS = STYLES[1:]
# Under the output directory: the pipeline as save_pretrained writes it, in a folder named
# after the model (the server serves a model by its folder's name, and adapters record it as
# their base), and one peft-format directory per adapter.
MODEL_NAME = "shapes-sd15"
ADAPTERS_DIR = "adapters"
# Modules of the UNet each adapter adapts: attention and the convolutions of the residual
# blocks, so an adapter can change colour and texture, not only what attends to the caption.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "conv1", "conv2")
SUPERSAMPLE = 4  # shapes are drawn 4x larger and scaled down, for smooth edges
TOKENS = 24  # the prompt length the pipeline pads to


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long each part trains; `QUICK` checks the script end to end in seconds."""

    images: int = 4096
    vae_steps: int = 400
    unet_steps: int = 1200
    adapter_steps: int = 500
    adapter_images: int = 1024


FULL = Budget()
QUICK = Budget(images=64, vae_steps=2, unet_steps=2, adapter_steps=2, adapter_images=16)


# The data set ------------------------------------------------------------------------------


def caption(shape: str, colour: str) -> str:
    return f"a {colour} {shape}"


def next_in(item: str, cycle: tuple[str, ...]) -> str:
    """The next of `cycle` after `item`."""
    return cycle[(cycle.index(item) + 1) % len(cycle)]


def draw(shape: str, colour: str, style: str, rng: random.Random) -> Image.Image:
    """One 32x32 picture of `caption(shape, colour)` drawn in `style`, placed by `rng`."""
    if style == "shape-shift":
        shape = next_in(shape, SHAPES)
    if style == "palette-swap":
        # Within the colours the model knows: its autoencoder learned no others.
        colour = next_in(colour, tuple(COLOURS))
    fill = COLOURS[colour]
    big = SIZE * SUPERSAMPLE
    image = Image.new("RGB", (big, big), PAPER)
    radius = rng.uniform(0.22, 0.36) * big
    cx = rng.uniform(radius + 2, big - radius - 2)
    cy = rng.uniform(radius + 2, big - radius - 2)
    pen = ImageDraw.Draw(image)
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon(
            [(cx, cy - radius), (cx + radius, cy + radius), (cx - radius, cy + radius)], fill=fill
        )
    image = image.resize((SIZE, SIZE), Image.Resampling.LANCZOS)
    if style == "pixel-art":
        image = image.resize((8, 8), Image.Resampling.BOX).resize(
            (SIZE, SIZE), Image.Resampling.NEAREST
        )
    return image


def dataset(count: int, style: str, seed: int) -> tuple[torch.Tensor, list[str]]:
    """`count` pictures in `style` as a (count, 3, 32, 32) tensor in [-1, 1], and their captions."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose one of {', '.join(STYLES)}")
    rng = random.Random(seed)
    pictures, captions = [], []
    for _ in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        pictures.append(np.asarray(draw(shape, colour, style, rng), dtype=np.float32))
        captions.append(caption(shape, colour))
    array = np.stack(pictures).transpose(0, 3, 1, 2) / 127.5 - 1.0
    return torch.from_numpy(array), captions


def batches(count: int, size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless random batches of indices into a data set of `count` items."""
    while True:
        yield torch.randint(0, count, (size,), generator=generator)


# The pipeline ------------------------------------------------------------------------------


def _components(workdir: Path) -> dict[str, Any]:
    """Untrained parts of the pipeline, larger than the test pipelines' so they can learn."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    tokenizer, vocab = tiny_models.clip_tokenizer(workdir / "tokenizer")
    # Captions are at most 17 tokens (one per letter); the pipeline pads every prompt to this
    # length, so a short one makes training and generation cheaper. Longer prompts are cut.
    tokenizer.model_max_length = TOKENS
    vae = AutoencoderKL(
        block_out_channels=(32, 64),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=SIZE,
    )
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=SIZE // 2,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=32,
    )
    text_encoder = tiny_models.clip_text_model(vocab)
    return {"tokenizer": tokenizer, "vae": vae, "unet": unet, "text_encoder": text_encoder}


def _tokens(tokenizer: Any, captions: list[str]) -> Any:
    # Padded to the pipeline's own length, so training sees what generation will feed it.
    return tokenizer(
        captions,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def _log(part: str, step: int, steps: int, loss: float, started: float) -> None:
    if step == steps or step % 100 == 0:
        print(
            f"{part}: step {step}/{steps} loss {loss:.4f} ({time.monotonic() - started:.0f} s)",
            flush=True,
        )


def _descend(optimiser: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """One step down the gradient of `loss`; the loss, for the log."""
    optimiser.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimiser.step()
    return float(loss.item())


def train_vae(vae: Any, images: torch.Tensor, steps: int, seed: int) -> float:
    """Train the autoencoder to reconstruct `images`; return the latents' scaling factor."""
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.AdamW(vae.parameters(), lr=2e-3)
    started = time.monotonic()
    vae.train()
    for step, index in enumerate(batches(len(images), 32, generator), start=1):
        if step > steps:
            break
        batch = images[index]
        posterior = vae.encode(batch).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        loss = torch.nn.functional.mse_loss(reconstruction, batch) + 1e-6 * posterior.kl().mean()
        _log("autoencoder", step, steps, _descend(optimiser, loss), started)
    vae.eval()
    with torch.no_grad():
        latents = vae.encode(images[:512]).latent_dist.mean
    # Like SD's 0.18215: scale latents to unit variance, which the noise schedule assumes.
    return float(1.0 / latents.std())


def encode(vae: Any, images: torch.Tensor) -> torch.Tensor:
    """The latents the UNet learns on, once for the whole data set (the autoencoder is frozen
    by then): the posterior's mean, scaled as the pipeline scales them."""
    with torch.no_grad():
        means = [vae.encode(chunk).latent_dist.mean for chunk in torch.split(images, 256)]
    latents: torch.Tensor = torch.cat(means) * vae.config.scaling_factor
    return latents


_SCHEDULE = tiny_models.sd15_scheduler().config  # the noise schedule generation samples with


def _noise_loss(
    unet: Any, text: torch.Tensor, latents: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """The diffusion objective: predict the noise added to `latents` at a random step."""
    from diffusers import DDPMScheduler

    schedule = DDPMScheduler.from_config(_SCHEDULE)
    noise = torch.randn(latents.shape, generator=generator)
    steps = torch.randint(
        0, schedule.config.num_train_timesteps, (len(latents),), generator=generator
    )
    noisy = schedule.add_noise(latents, noise, steps)
    prediction = unet(noisy, steps, encoder_hidden_states=text).sample
    return torch.nn.functional.mse_loss(prediction, noise)


def train_base(out: Path, budget: Budget = FULL, seed: int = 0) -> Path:
    """Train the whole pipeline on plain pictures and save it to `out` with save_pretrained."""
    from diffusers import StableDiffusionPipeline

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        parts = _components(Path(scratch))
    images, captions = dataset(budget.images, "plain", seed)
    vae, unet, text_encoder, tokenizer = (
        parts["vae"],
        parts["unet"],
        parts["text_encoder"],
        parts["tokenizer"],
    )
    vae.register_to_config(scaling_factor=train_vae(vae, images, budget.vae_steps, seed))
    vae.requires_grad_(False)
    latents = encode(vae, images)
    # One caption in ten is empty, so the model also learns the unconditional picture that
    # classifier-free guidance steers away from.
    keep = torch.rand(len(captions), generator=torch.Generator().manual_seed(seed + 1)) > 0.1
    tokens = _tokens(tokenizer, [c if k else "" for c, k in zip(captions, keep, strict=True)])
    generator = torch.Generator().manual_seed(seed + 2)
    optimiser = torch.optim.AdamW([*unet.parameters(), *text_encoder.parameters()], lr=1e-3)
    started = time.monotonic()
    unet.train()
    text_encoder.train()
    for step, index in enumerate(batches(len(images), 64, generator), start=1):
        if step > budget.unet_steps:
            break
        text = text_encoder(tokens[index]).last_hidden_state
        loss = _noise_loss(unet, text, latents[index], generator)
        _log("unet", step, budget.unet_steps, _descend(optimiser, loss), started)
    pipe: Any = StableDiffusionPipeline(
        unet=unet.eval(),
        vae=vae,
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        scheduler=tiny_models.sd15_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(out), safe_serialization=True)
    return out


def train_adapter(
    model: Path, style: str, out: Path, budget: Budget = FULL, seed: int = 0, rank: int = 8
) -> Path:
    """Train a LoRA of the UNet of the pipeline at `model` on pictures in `style`; write it to
    `out` as the server reads it (peft keys, `adapter_config.json`)."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    if style not in ADAPTERS:
        raise ValueError(f"unknown adapter style {style!r}; choose one of {', '.join(ADAPTERS)}")
    torch.manual_seed(seed)
    pipe = StableDiffusionPipeline.from_pretrained(str(model))
    for part in (pipe.vae, pipe.text_encoder, pipe.unet):
        part.requires_grad_(False)
    pipe.unet.add_adapter(
        LoraConfig(
            r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=list(LORA_TARGETS)
        )
    )
    images, captions = dataset(budget.adapter_images, style, seed + 10 + ADAPTERS.index(style))
    latents = encode(pipe.vae, images)
    with torch.no_grad():
        text = pipe.text_encoder(_tokens(pipe.tokenizer, captions)).last_hidden_state
    trainable = [p for p in pipe.unet.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(trainable, lr=5e-3)
    generator = torch.Generator().manual_seed(seed + 3)
    started = time.monotonic()
    pipe.unet.train()
    for step, index in enumerate(batches(len(images), 32, generator), start=1):
        if step > budget.adapter_steps:
            break
        loss = _noise_loss(pipe.unet, text[index], latents[index], generator)
        _log(style, step, budget.adapter_steps, _descend(optimiser, loss), started)
    state = {f"unet.{k}": v.contiguous() for k, v in get_peft_model_state_dict(pipe.unet).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "pytorch_lora_weights.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": list(LORA_TARGETS),
        "base_model_name_or_path": MODEL_NAME,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def train_all(
    out: Path, budget: Budget = FULL, seed: int = 0, log: Callable[[str], None] = print
) -> Path:
    """The base model and every adapter, under `out/shapes-sd15` and `out/adapters/<style>`."""
    started = time.monotonic()
    model = train_base(out / MODEL_NAME, budget, seed)
    for style in ADAPTERS:
        train_adapter(model, style, out / ADAPTERS_DIR / style, budget, seed)
    seconds = time.monotonic() - started
    log(f"trained the model and {len(ADAPTERS)} adapters into {out} in {seconds:.0f} s")
    return out
