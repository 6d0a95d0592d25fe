# The operator image: `python -m lora_operator` with the [operator] extra only (kopf, aiohttp,
# huggingface_hub, boto3). No torch: the safetensors checks it shares with the server import none.
#
#   docker build -f docker/operator.Dockerfile -t lora-operator/operator:0.1.0 .
#
# The chart runs it as uid 65532 with a read-only root filesystem and a /tmp emptyDir.
# `make images` builds it without Docker (buildah) from a local Debian base: BASE_IMAGE.
# pip's cache is a build cache mount, never a layer: the final stage copies only the venv.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# setuptools finds the packages under inference/ and operator/ (pyproject.toml); the operator
# imports lora_inference's file checks, which need no torch. devcluster/ (the local cluster, a
# development tool) stays out, so changing it rebuilds no image; its console script is inert here.
COPY pyproject.toml README.md ./
COPY inference/ inference/
COPY operator/ operator/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[operator]" \
    && ! pip show torch >/dev/null 2>&1

FROM ${BASE_IMAGE}
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["python", "-m", "lora_operator"]
