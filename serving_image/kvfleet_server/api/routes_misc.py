"""GET /health, /metrics, /v1/models, /version; POST /tokenize, /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from importlib.metadata import PackageNotFoundError, version as _pkg_version

from ..errors import InvalidRequestError
from .convert import check_text, check_token_ids
from .errors import error_body
from .protocol import (DetokenizeRequest, DetokenizeResponse, ErrorResponse, ModelCard, ModelList, TokenizeRequest,
                       TokenizeResponse)
from .routes_openai import _vocab_size, render_chat

router = APIRouter()


@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """200 only when a request would be served now; 503 while loading, draining or after an engine failure."""
    state = request.app.state.kv
    if state.ready:
        return Response(status_code=200)
    if state.fatal_error is not None:
        reason = f"failed: {state.fatal_error}"
    elif state.drain.draining:
        reason = "draining"
    elif state.engine is None:
        reason = "loading" if state.load_error is None else f"load failed: {state.load_error}"
    else:
        reason = f"engine stopped: {state.engine.dead_error}"
    return JSONResponse(error_body(503, f"not ready: {reason}", code=reason.split(":")[0]), status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (vLLM metric names)."""
    return Response(request.app.state.kv.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict:
    try:
        return {"version": _pkg_version("kvfleet")}
    except PackageNotFoundError:
        return {"version": "unknown"}


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request):
    state = request.app.state.kv
    if state.llm is None:  # max_model_len is only known once the model is loaded: 503 like generation
        state.require_engine()
    cards = [ModelCard(id=name, created=state.created, root=state.settings.root or name,
                       max_model_len=state.max_model_len) for name in state.settings.served_model_names]
    cards += [ModelCard(id=lora.name, created=state.created, root=lora.path,
                        parent=lora.base_model_name or state.model_name, max_model_len=state.max_model_len)
              for lora in state.llm.list_loras()]
    return ModelList(data=cards)


@router.post("/tokenize", response_model=TokenizeResponse, responses={400: {"model": ErrorResponse}})
async def tokenize(body: TokenizeRequest, request: Request):
    """Token ids of ``prompt`` (or of the chat template applied to ``messages``)."""
    state = request.app.state.kv
    state.check_model(body.model)
    state.require_engine()
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        if not body.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
        text = render_chat(state, body)
        add_special = False
    else:
        check_text(body.prompt, "prompt")
        text, add_special = body.prompt, body.add_special_tokens
    tok = state.tokenizer
    ids = list(await state.engine.call(lambda: tok.encode(text, add_special_tokens=add_special)))
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse, responses={400: {"model": ErrorResponse}})
async def detokenize(body: DetokenizeRequest, request: Request):
    state = request.app.state.kv
    state.check_model(body.model)
    state.require_engine()
    check_token_ids(body.tokens, _vocab_size(state.llm), "tokens")
    tok = state.tokenizer
    return DetokenizeResponse(prompt=await state.engine.call(lambda: tok.decode(body.tokens)))
