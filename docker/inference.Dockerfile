# The inference image: `lora-inference` with the [inference] extra (torch 2.13.0 with CUDA,
# diffusers, peft, transformers), pinned in pyproject.toml.
#
#   docker build -f docker/inference.Dockerfile -t lora-operator/inference:0.1.0 .
#
# torch's Linux wheels on PyPI are CUDA builds that carry the CUDA runtime libraries (the nvidia-*
# wheels), so a slim Python base is enough: the node needs only the NVIDIA driver and the
# container toolkit. For another CUDA build, point TORCH_INDEX_URL at its index, e.g.
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# `make images` builds it without Docker (buildah) from a local Debian base: BASE_IMAGE.
# pip's cache is a build cache mount, never a layer: the final stage copies only the venv.
# The model is not in the image: mount it (inference.model.existingClaim) or build FROM this image
# and COPY it to the chart's inference.model.path.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first, from the chosen index, at the version pyproject.toml pins.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "$TORCH_INDEX_URL" "torch==2.13.0"
# devcluster/ (the local cluster, a development tool) stays out, as in the operator image.
COPY pyproject.toml README.md ./
COPY inference/ inference/
COPY operator/ operator/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[inference]"

FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
# The root filesystem is read-only in the chart: caches go to /tmp (an emptyDir there).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    HF_HUB_OFFLINE=1
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["lora-inference"]
CMD ["--help"]
