"""A Hugging Face Hub stand-in: one model repository served from a folder, over the endpoints
huggingface_hub's `snapshot_download` (and so `hf download`) calls, with the headers it reads.

What the client asks, in order (huggingface_hub 2.x, `_snapshot_download.py` and
`file_download.py`):

- `GET /api/models/{repo_id}/revision/{revision}`: the repository's info; the client takes
  `sha` (the commit the rest of the download pins) and older clients `siblings`.
- `GET /api/models/{repo_id}/tree/{commit}?recursive=True`: the file list (`type`, `path`,
  `size`, `oid`, and `lfs` for large files), in one page (no `Link: next`).
- `HEAD /{repo_id}/resolve/{commit}/{path}`: `X-Repo-Commit`, `ETag` (`X-Linked-Etag` and
  `X-Linked-Size` for LFS files, as the Hub sends them) and `Content-Length`; no `X-Xet-*`
  header and no `xetHash` in the tree, so the client never takes the Xet path.
- `GET` of the same URL: the bytes (a `Range: bytes=N-` resumes a partial file).

With a token, every request without `Authorization: Bearer <token>` is answered 401 with
`X-Error-Code: GatedRepo`, as the Hub answers for a gated repository.

It imports only aiohttp and the standard library, so the same file runs as a script in a pod of
the inference image (`python hubstandin.py --folder DIR --repo-id ORG/NAME`): the end-to-end
test mounts it from a ConfigMap. Must not: import the project's packages or the test harness.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from aiohttp import web

# Files the Hub keeps in LFS (so announces with an `lfs` entry and X-Linked-* headers).
LFS_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".onnx", ".msgpack", ".h5")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class RepoFile:
    path: str  # posix, relative to the repository's root
    size: int
    sha256: str
    git_oid: str  # the git blob id: what the Hub's ETag is for a file not in LFS
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


@dataclass(frozen=True)
class Repository:
    """One model repository: its id, the folder it is read from, its files and its commit."""

    repo_id: str
    folder: Path
    files: dict[str, RepoFile] = field(default_factory=dict)
    sha: str = ""

    @classmethod
    def from_folder(cls, repo_id: str, folder: Path) -> Repository:
        """Every file under `folder` (hidden ones left out, as a clone's `.git`), hashed once;
        the commit id is a hash of the listing, so it changes when any file does."""
        files: dict[str, RepoFile] = {}
        for path in sorted(folder.rglob("*")):
            rel = PurePosixPath(path.relative_to(folder).as_posix())
            if not path.is_file() or any(part.startswith(".") for part in rel.parts):
                continue
            data = path.read_bytes()
            files[str(rel)] = RepoFile(
                path=str(rel),
                size=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                git_oid=hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                lfs=rel.name.endswith(LFS_SUFFIXES),
            )
        listing = "\n".join(f"{f.path} {f.git_oid}" for f in files.values())
        sha = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        return cls(repo_id=repo_id, folder=folder, files=files, sha=sha)

    def knows(self, revision: str) -> bool:
        return revision in ("main", self.sha)


@dataclass
class Log:
    """What reached the stand-in: (method, path, whether it was authorised)."""

    requests: list[tuple[str, str, bool]] = field(default_factory=list)


REPOSITORY = web.AppKey("repository", Repository)
TOKEN = web.AppKey("token", str)  # "" when none is required
LOG = web.AppKey("log", Log)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, code: str, message: str) -> web.Response:
    # The Hub's error shape: the code in X-Error-Code, the message in the body and a header.
    headers = {"X-Error-Code": code, "X-Error-Message": message}
    return web.json_response({"error": message}, status=status, headers=headers)


@web.middleware
async def _authorise(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[TOKEN]
    allowed = not token or request.headers.get("Authorization") == f"Bearer {token}"
    request.app[LOG].requests.append((request.method, request.path, allowed))
    if not allowed:
        repo = request.app[REPOSITORY].repo_id
        return _error(
            401,
            "GatedRepo",
            f"Access to model {repo} is restricted. You must have access to it and be "
            "authenticated to access it. Please log in.",
        )
    return await handler(request)


def _repository(request: web.Request) -> Repository:
    repo = request.app[REPOSITORY]
    asked = f"{request.match_info['org']}/{request.match_info['name']}"
    if asked != repo.repo_id:
        raise web.HTTPNotFound(
            headers={"X-Error-Code": "RepoNotFound"}, text=f"Repository {asked} not found"
        )
    revision = request.match_info["revision"]
    if not repo.knows(revision):
        raise web.HTTPNotFound(
            headers={"X-Error-Code": "RevisionNotFound"}, text=f"Invalid rev id: {revision}"
        )
    return repo


async def model_info(request: web.Request) -> web.Response:
    repo = _repository(request)
    return web.json_response(
        {
            "_id": repo.sha[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": repo.sha,
            "private": False,
            "gated": "manual" if request.app[TOKEN] else False,
            "disabled": False,
            "tags": ["diffusers"],
            "siblings": [{"rfilename": path} for path in repo.files],
        }
    )


def _tree_entry(f: RepoFile) -> dict[str, object]:
    entry: dict[str, object] = {"type": "file", "path": f.path, "size": f.size, "oid": f.git_oid}
    if f.lfs:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
    return entry


async def tree(request: web.Request) -> web.Response:
    repo = _repository(request)
    under = request.match_info.get("path", "").strip("/")
    recursive = request.query.get("recursive", "false").lower() == "true"
    prefix = f"{under}/" if under else ""
    entries: list[dict[str, object]] = []
    folders: set[str] = set()
    for f in repo.files.values():
        if not f.path.startswith(prefix):
            continue
        rest = f.path[len(prefix) :].split("/")
        for depth in range(1, len(rest)):  # the folders on the way
            if recursive or depth == 1:
                folders.add(prefix + "/".join(rest[:depth]))
        if recursive or len(rest) == 1:
            entries.append(_tree_entry(f))
    if under and not entries and not folders:
        return _error(404, "EntryNotFound", f"{under} does not exist on {repo.sha}")
    dirs = [{"type": "directory", "path": d, "size": 0, "oid": repo.sha} for d in sorted(folders)]
    return web.json_response(dirs + entries)


async def resolve(request: web.Request) -> web.StreamResponse:
    repo = _repository(request)
    f = repo.files.get(request.match_info["path"])
    if f is None:
        return _error(404, "EntryNotFound", f"{request.match_info['path']} does not exist")
    headers = {
        "X-Repo-Commit": repo.sha,
        "ETag": f'"{f.etag}"',
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    if f.lfs:
        headers["X-Linked-Etag"] = f'"{f.sha256}"'
        headers["X-Linked-Size"] = str(f.size)
    if request.method == "HEAD":
        headers["Content-Length"] = str(f.size)
        return web.Response(status=200, headers=headers)
    data = (repo.folder / f.path).read_bytes()
    match = _RANGE.match(request.headers.get("Range", ""))
    if match:
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else f.size - 1
        if start >= f.size or end < start:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{f.size}"})
        headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        return web.Response(status=206, body=data[start : end + 1], headers=headers)
    return web.Response(status=200, body=data, headers=headers)


def create_app(repository: Repository, token: str | None = None) -> web.Application:
    """The stand-in for `repository`; with `token`, every request must carry it."""
    app = web.Application(middlewares=[_authorise])
    app[REPOSITORY] = repository
    app[TOKEN] = token or ""
    app[LOG] = Log()
    repo = "/{org}/{name}"
    app.router.add_get(f"/api/models{repo}/revision/{{revision}}", model_info)
    app.router.add_get(f"/api/models{repo}/tree/{{revision}}", tree)
    app.router.add_get(f"/api/models{repo}/tree/{{revision}}/{{path:.+}}", tree)
    app.router.add_get(f"{repo}/resolve/{{revision}}/{{path:.+}}", resolve)  # HEAD too
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve one model repository as the Hub does.")
    parser.add_argument("--folder", type=Path, required=True, help="the repository's files")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--token-file", type=Path, help="require this bearer token")
    args = parser.parse_args(argv)
    # One access-log line per request on stderr: what reached the stand-in, for the tests.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    token = args.token_file.read_text().strip() if args.token_file else None
    repository = Repository.from_folder(args.repo_id, args.folder)
    listing = {"repo_id": repository.repo_id, "sha": repository.sha, "files": len(repository.files)}
    print(json.dumps(listing), flush=True)
    web.run_app(create_app(repository, token), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
