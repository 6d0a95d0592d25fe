"""`python -m lora_operator.admintoken --namespace NS --name NAME`: the admin token's Secret,
created once when it is missing and never changed afterwards.

The chart runs this as a hook Job (pre-install and pre-upgrade) instead of rendering the token:
a token rendered by the chart is a new random one at every render wherever the renderer cannot
read the cluster (Argo CD, `helm template | kubectl apply`), so each sync would hand the pods and
the operator a new token. Created here, the Secret is no part of any rendered manifest, so no
sync rewrites or prunes it. The operator and the inference pods read it from the mounted Secret
as before.

A Secret that an earlier chart rendered (it carries Helm's release annotations) is kept as it
is and annotated `helm.sh/resource-policy: keep`: the upgrade that stops rendering it would
otherwise delete it, and every pod with it.

Owns: creating the Secret and marking a rendered one to be kept. Must not: read, log or
change the token of a Secret that exists.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import aiohttp
from lora_runtime import login

from lora_operator.edges import kube

TOKEN_BYTES = 32
KEEP = {"helm.sh/resource-policy": "keep"}
HELM_RELEASE_ANNOTATION = "meta.helm.sh/release-name"
ATTEMPTS = 30
RETRY_SECONDS = 2.0

Action = Literal["create", "keep", "exists"]


def new_token() -> str:
    """A random token: 32 bytes from the OS's CSPRNG, URL-safe (43 characters)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def build_secret(
    namespace: str, name: str, token: str, labels: Mapping[str, str]
) -> dict[str, Any]:
    """The Secret to create (pure)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"namespace": namespace, "name": name, "labels": dict(labels)},
        "type": "Opaque",
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


def plan(existing: Mapping[str, Any] | None) -> Action:
    """What to do with the Secret as it is now (pure): create it when missing; mark one an
    earlier chart rendered (Helm's release annotation, no keep policy yet) to be kept; leave
    any other alone."""
    if existing is None:
        return "create"
    annotations = (existing.get("metadata") or {}).get("annotations") or {}
    if (
        HELM_RELEASE_ANNOTATION in annotations
        and annotations.get("helm.sh/resource-policy") != KEEP["helm.sh/resource-policy"]
    ):
        return "keep"
    return "exists"


async def ensure_secret(
    api: kube.KubeApi, namespace: str, name: str, labels: Mapping[str, str]
) -> Action:
    """Create the Secret if it is missing; returns what was done. Never overwrites: a Secret
    created meanwhile by another run (409) is left as that run wrote it."""
    path = f"/api/v1/namespaces/{namespace}/secrets"
    try:
        existing = await api.request("GET", f"{path}/{name}")
    except kube.ApiError as e:
        if e.status != 404:
            raise
        existing = None
    action = plan(existing)
    if action == "create":
        try:
            await api.request("POST", path, build_secret(namespace, name, new_token(), labels))
        except kube.ApiError as e:
            if e.status != 409:
                raise
            return "exists"
    elif action == "keep":
        body = {"metadata": {"annotations": KEEP}}
        await api.request("PATCH", f"{path}/{name}", body, "application/merge-patch+json")
    return action


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lora_operator.admintoken",
        description="Create the admin token's Secret (key `token`) when it is missing; an "
        "existing one is never changed.",
    )
    parser.add_argument("--name", required=True, help="the Secret's name")
    parser.add_argument(
        "--namespace", help="the Secret's namespace (default: this pod's namespace)"
    )
    parser.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="a label; repeatable"
    )
    return parser


async def _run(namespace: str, name: str, labels: Mapping[str, str]) -> Action:
    info = login.in_cluster()
    if info is None:
        raise SystemExit("admintoken: not in a pod (no service account token)")
    api = kube.KubeApi(info, instance="lora-operator-admintoken")
    attempt = 1
    try:
        while True:
            try:
                return await ensure_secret(api, namespace, name, labels)
            except (TimeoutError, aiohttp.ClientError, OSError, kube.ApiError) as e:
                # The API server may be out of reach for a moment after the pod starts, or
                # answer 5xx: retry those. Any other API error (RBAC, a bad name) is final.
                if (isinstance(e, kube.ApiError) and e.status < 500) or attempt >= ATTEMPTS:
                    raise
                print(f"admintoken: the API server did not answer ({e}); retrying", flush=True)
                attempt += 1
                await asyncio.sleep(RETRY_SECONDS)
    finally:
        await api.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    namespace = args.namespace or login.pod_namespace()
    if not namespace:
        print("admintoken: --namespace is required outside a pod", file=sys.stderr)
        return 2
    try:
        action = asyncio.run(_run(namespace, args.name, _labels(args.label)))
    except kube.ApiError as e:
        print(f"admintoken: Secret {namespace}/{args.name}: {e}", file=sys.stderr)
        return 1
    said = {
        "create": "created with a new token",
        "keep": "exists (rendered by an earlier chart); annotated to be kept on upgrade",
        "exists": "exists; left unchanged",
    }
    print(f"admintoken: Secret {namespace}/{args.name} {said[action]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
