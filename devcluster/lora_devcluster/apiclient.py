"""A small async client for the Kubernetes API (aiohttp, admin client certificate).

Owns: the HTTP calls the kubelet and the harness make (get, list, create, patch, delete) and
mapping API errors to `ApiError` with the server's message.
Must not: decide anything; callers decide what to do with a 404 or 409.
"""

from __future__ import annotations

import json
import ssl
from pathlib import Path
from typing import Any

import aiohttp

Obj = dict[str, Any]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"API server answered {status}: {message}")
        self.status = status


class ApiClient:
    def __init__(self, server: str, ca: Path, cert: Path, key: Path) -> None:
        self._server = server.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=str(ca))
        self._ssl.load_cert_chain(str(cert), str(key))
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ApiClient:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=30),
            connector=aiohttp.TCPConnector(ssl=self._ssl),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Obj | None = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        if self._session is None:
            raise RuntimeError("ApiClient used outside `async with`")
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._session.request(
            method, self._server + path, data=data, headers=headers, params=params
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise ApiError(resp.status, message)
            result: Obj = json.loads(text) if text else {}
            return result

    async def get(self, path: str, params: dict[str, str] | None = None) -> Obj:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Obj) -> Obj:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, body: Obj) -> Obj:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")

    async def delete(self, path: str, body: Obj | None = None) -> Obj:
        return await self.request("DELETE", path, body)

    async def get_or_none(self, path: str) -> Obj | None:
        try:
            return await self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise


def pod_path(namespace: str, name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}" + (f"/{sub}" if sub else "")
