"""Test support: model stores on 127.0.0.1 that the real clients (huggingface_hub, boto3) talk to.

``FakeHub`` — a small FastAPI app serving the Hugging Face Hub endpoints huggingface_hub 2.x calls
(read from its source: ``HfApi.model_info`` / ``repo_info`` → ``GET /api/models/{repo}[/revision/{rev}]``;
``list_repo_tree`` → ``GET /api/models/{repo}/tree/{rev}?recursive=``; ``hf_hub_download`` →
``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag``, ``Content-Length``),
with the Hub's error headers (``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound``, a 401
for a private repository without its token). Repositories have commits (``commit``), branches and
tags (``refs``); every request is logged in ``requests`` so a test can say what was never fetched.
Point clients at it with ``HF_ENDPOINT`` (or ``HfApi(endpoint=...)``).

``moto_s3()`` — moto's S3 emulator in server mode (``ThreadedMotoServer``) on a free port, for boto3
through ``endpoint_url``.

``serve_app(app)`` — run an ASGI app with uvicorn in a thread; yields its base URL.
"""
from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(app) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 (uvicorn, in a daemon thread) until the block ends; yields the URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


@dataclass
class Repo:
    """A repository: commits (sha -> files) in order, refs (branch/tag -> sha), and a token that is needed
    for everything (private) or, ``gated``, for the files only (the listing stays public)."""
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None
    gated: bool = False


class FakeHub:
    """An in-memory Hugging Face Hub (see the module docstring)."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.app = self._build()

    def commit(self, repo_id: str, files: dict[str, bytes], branch: str = "main", token: str | None = None,
               gated: bool = False, tags: tuple[str, ...] = ()) -> str:
        """Add a commit holding exactly ``files`` (path -> content) on ``branch``; returns its sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        if token is not None:
            repo.token, repo.gated = token, gated
        sha = hashlib.sha1(f"{repo_id}:{len(repo.commits)}:{sorted(files)}".encode()).hexdigest()
        repo.commits[sha] = dict(files)
        repo.refs[branch] = sha
        for tag in tags:
            repo.refs[tag] = sha
        return sha

    def fetched(self, suffix: str) -> bool:
        """Whether any request's path ended with ``suffix`` (a file's content or metadata was asked for)."""
        return any(path.endswith(suffix) for _, path in self.requests)

    # -------------------------------------------------------------------------------------- app
    def _lookup(self, request: Request, repo_id: str, revision: str,
                files: bool = False) -> tuple[str, dict[str, bytes]] | Response:
        repo = self.repos.get(repo_id)
        if repo is None:
            return Response(status_code=404, headers={"X-Error-Code": "RepoNotFound"})
        if repo.token is not None and (files or not repo.gated) \
                and request.headers.get("authorization") != f"Bearer {repo.token}":
            code = "GatedRepo" if repo.gated else "RepoNotFound"  # as the Hub: a private repository looks absent
            return Response(status_code=401 if not repo.gated else 403, headers={"X-Error-Code": code})
        sha = revision if revision in repo.commits else repo.refs.get(revision)
        if sha is None:
            return Response(status_code=404, headers={"X-Error-Code": "RevisionNotFound"})
        return sha, repo.commits[sha]

    def _build(self) -> FastAPI:
        app = FastAPI()
        hub = self

        @app.middleware("http")
        async def log(request: Request, call_next):
            hub.requests.append((request.method, request.url.path))
            return await call_next(request)

        def info(request: Request, org: str, name: str, revision: str):
            found = hub._lookup(request, f"{org}/{name}", revision)
            if isinstance(found, Response):
                return found
            sha, files = found
            siblings = [{"rfilename": p, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
                        for p, b in sorted(files.items())]
            return JSONResponse({"id": f"{org}/{name}", "modelId": f"{org}/{name}", "sha": sha, "private": False,
                                 "gated": False, "disabled": False, "tags": [], "siblings": siblings})

        @app.get("/api/models/{org}/{name}")
        def model_info(request: Request, org: str, name: str):
            return info(request, org, name, "main")

        @app.get("/api/models/{org}/{name}/revision/{revision:path}")
        def model_info_at(request: Request, org: str, name: str, revision: str):
            return info(request, org, name, revision)

        @app.get("/api/models/{org}/{name}/tree/{revision:path}")
        def tree(request: Request, org: str, name: str, revision: str):
            found = hub._lookup(request, f"{org}/{name}", revision)
            if isinstance(found, Response):
                return found
            _, files = found
            return JSONResponse([{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                 for p, b in sorted(files.items())])

        @app.api_route("/{org}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        def resolve(request: Request, org: str, name: str, revision: str, path: str):
            found = hub._lookup(request, f"{org}/{name}", revision, files=True)
            if isinstance(found, Response):
                return found
            sha, files = found
            if path not in files:
                return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound"})
            body = files[path]
            headers = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                       "Content-Length": str(len(body))}
            if request.method == "HEAD":
                return Response(status_code=200, headers=headers)
            return Response(content=body, status_code=200, headers=headers, media_type="application/octet-stream")

        return app


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 emulator (server mode) on 127.0.0.1; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
