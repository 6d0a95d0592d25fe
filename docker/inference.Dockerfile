# The inference image: `lora-inference` with the [inference] extra (torch 2.13.0 with CUDA,
# diffusers, peft, transformers), pinned in pyproject.toml.
#
#   docker build -f docker/inference.Dockerfile -t lora-operator/inference:0.2.0 .
#
# torch's Linux wheels on PyPI are CUDA builds that carry the CUDA runtime libraries (the nvidia-*
# wheels), so a slim Python base is enough: the node needs only the NVIDIA driver and the
# container toolkit. For another CUDA build, point TORCH_INDEX_URL at its index, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# `make images` builds it without Docker (buildah) from a local Debian base: BASE_IMAGE.
# Layers: the dependencies (5 GB: torch and the CUDA wheels) come from pyproject.toml alone, so a
# change to the project's code rebuilds only the small layers after them. pip's cache is a build
# cache mount, never a layer.
# Your model is not in the image: mount it (inference.model.existingClaim) or build FROM this image
# and COPY it to the chart's inference.model.path. The image does carry the demo's small trained
# model and its adapters (models/shapes, about 7 MB) at /opt/lora/shapes, which `make demo`
# copies onto its claims.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml ./
# torch first, from the chosen index, at the version pyproject.toml pins; then the [inference]
# extra and the build backend, read from pyproject.toml.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0" \
    && python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
print("\n".join(p["build-system"]["requires"] + p["project"]["optional-dependencies"]["inference"]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# The project itself, without dependencies (they are all above): the server, the volume
# contract and the pod API it shares with the operator and the router (lora_volume,
# lora_podapi), and what every process of the product runs on (lora_runtime). operator/,
# router/ and devcluster/ stay out: the server imports none of them, and changing them rebuilds
# no inference image.
COPY models/shapes/ /opt/lora/shapes/
# Readable by the non-root user whatever the modes in the build context (diffusers writes weights
# 0600; a git checkout has 0644).
RUN chmod -R a+rX /opt/lora/shapes
COPY README.md ./
COPY runtime/ runtime/
COPY podapi/ podapi/
COPY volume/ volume/
COPY inference/ inference/
COPY playground/ playground/
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && rm -rf /src/build /src/*.egg-info
WORKDIR /
# The root filesystem is read-only in the chart: caches go to /tmp (an emptyDir there).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    HF_HUB_OFFLINE=1
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["lora-inference"]
CMD ["--help"]
