# The operator image: `python -m lora_operator` with the [operator] extra only (kopf, aiohttp,
# huggingface_hub, boto3). No torch and no inference server: what it shares with the server (the
# volume layout, the safetensors checks, the selectors) is lora_volume, the pods' JSON is
# lora_podapi, and what every process runs on (the API client, token files, metrics)
# lora_runtime; none of them imports torch.
# The router (`python -m lora_router`, the chart's router Deployment) runs from this image too: it
# needs nothing beyond the same extra, so no third image is built, pulled or patched.
#
#   docker build -f docker/operator.Dockerfile -t lora-operator/operator:0.2.0 .
#
# The chart runs it as uid 65532 with a read-only root filesystem and a /tmp emptyDir.
# `make images` builds it without Docker (buildah) from a local Debian base: BASE_IMAGE.
# Layers: the dependencies come from pyproject.toml alone, so a change to the project's code
# rebuilds only the small layers after them. pip's cache is a build cache mount, never a layer.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml ./
# The [operator] extra and the build backend, read from pyproject.toml.
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); \
print("\n".join(p["build-system"]["requires"] + p["project"]["optional-dependencies"]["operator"]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
# setuptools finds the packages under the folders copied here (pyproject.toml). inference/ stays
# out (an import contract keeps the operator and the router off lora_inference), and so does
# devcluster/ (the local cluster, a development tool), so changing either rebuilds no operator
# image; their console scripts are inert here.
COPY README.md ./
COPY runtime/ runtime/
COPY podapi/ podapi/
COPY volume/ volume/
COPY operator/ operator/
COPY router/ router/
COPY playground/ playground/
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && rm -rf /src/build /src/*.egg-info \
    && ! pip show torch >/dev/null 2>&1
WORKDIR /
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["python", "-m", "lora_operator"]
