"""The FastAPI application: OpenAI routes, /health, /metrics, OpenAI-shaped errors, API keys, drain.

``build_app(state)`` wires a ``ServerState`` (which owns the engine bridge) into a FastAPI app; the
engine is attached (or loaded in a worker thread) in the app's lifespan and stopped on shutdown.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from .drain import InflightMiddleware
from .errors import error_body, install_error_handlers
from .routes_lora import router as lora_router, runtime_lora_updating
from .routes_misc import router as misc_router
from .routes_openai import router as openai_router
from .routes_render import router as render_router
from .state import ServerSettings, ServerState

OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


class APIKeyMiddleware:
    """Pure ASGI middleware: every path but health, metrics, version and docs needs ``Bearer <api_key>``.

    Runs before body parsing, so a request without the key gets 401 whatever its body.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        if secrets.compare_digest(auth, self.expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                     code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def build_app(state: ServerState) -> FastAPI:
    """FastAPI app serving ``state``'s engine. The engine starts with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(state.start())
        app.state.loader = loader
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()
            state.shutdown()

    app = FastAPI(title="kvfleet OpenAI-compatible server", version="0.1.0", lifespan=lifespan)
    app.state.kv = state
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(render_router)
    app.include_router(misc_router)
    if runtime_lora_updating():  # vLLM mounts the runtime LoRA API only then
        app.include_router(lora_router)
    app.add_middleware(InflightMiddleware, drain=state.drain)
    if state.settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.settings.api_key)
    if state.settings.cors is not None:  # outermost: preflights are answered before the key check
        app.add_middleware(CORSMiddleware, **state.settings.cors)
    return app


__all__ = ["build_app", "ServerSettings", "ServerState"]
