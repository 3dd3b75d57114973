"""POST /v1/completions/render and /v1/chat/completions/render: a request's prompt as token ids, nothing
generated (vLLM's render endpoints).

Precise prefix routing needs them: llm-d's ``token-producer`` posts each request's body here to learn the
exact tokens the model server will cache, then looks those blocks up in the index it built from the
replicas' KV events (docs/routing.md). The answer is the prompt part of vLLM's ``GenerateRequest`` —
``request_id``, ``token_ids``, ``model`` and ``cache_salt`` — one per prompt for completions (a list), one
for chat; tokenization is the one /v1/completions and /v1/chat/completions apply (same special tokens,
chat template, tools). Sampling parameters are not rendered.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from .convert import completion_prompts
from .protocol import ChatCompletionRequest, CompletionRequest, random_id
from .routes_openai import ERRORS, _check_prompt, render_chat
from .tools import plan_tools

router = APIRouter()


def _generate_request(prefix: str, token_ids: list[int], model: str, cache_salt: str | None) -> dict:
    return {"request_id": random_id(prefix), "token_ids": token_ids, "model": model, "cache_salt": cache_salt}


@router.post("/v1/completions/render", responses=ERRORS)
async def render_completion(body: CompletionRequest, request: Request) -> list[dict]:
    """One ``{request_id, token_ids, model, cache_salt}`` per prompt of a /v1/completions body."""
    state = request.app.state.kv
    state.check_model(body.model)
    engine = state.require_engine()
    prompts = completion_prompts(body.prompt)
    for p in prompts:
        _check_prompt(state, p)
    tok = state.tokenizer
    ids = await engine.call(lambda: [p if isinstance(p, list) else list(tok.encode(p, add_special_tokens=body.add_special_tokens))
                                     for p in prompts])
    return [_generate_request("cmpl", t, state.model_name, body.cache_salt) for t in ids]


@router.post("/v1/chat/completions/render", responses=ERRORS)
async def render_chat_completion(body: ChatCompletionRequest, request: Request) -> dict:
    """``{request_id, token_ids, model, cache_salt}`` of a /v1/chat/completions body (its chat template applied)."""
    state = request.app.state.kv
    state.check_model(body.model)
    engine = state.require_engine()
    settings = state.settings
    prompt = render_chat(state, body, plan_tools(body, settings.enable_auto_tool_choice, settings.tool_call_parser))
    tok = state.tokenizer
    ids = await engine.call(lambda: list(tok.encode(prompt, add_special_tokens=False)))
    return _generate_request("chatcmpl", ids, state.model_name, body.cache_salt)
