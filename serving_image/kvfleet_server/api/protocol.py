"""Pydantic models of the OpenAI-compatible HTTP API (requests and responses).

Shapes follow OpenAI's Completions and Chat Completions APIs plus vLLM's extra sampling fields
(top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, ...), so the official
``openai`` client and vLLM users' ``extra_body`` work unchanged. Range checks that belong to the
engine (top_p in (0, 1], penalties in [-2, 2], ...) live in ``SamplingParams.validate`` so that every
front end refuses the same bad input with the same message; bounds here only keep absurd values
(NaN, n = 10^9, 80-bit seeds) away from the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 64  # completions per prompt; each one occupies a running slot
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = int


class _Request(BaseModel):
    """Base of request bodies: rejects NaN/inf floats; unknown fields are ignored (as vLLM does)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = None


class _SamplingFields(_Request):
    """Sampling fields common to both endpoints (vLLM's extensions included)."""

    model: str | None = None
    temperature: float | None = Field(None, description="0 = greedy; default 1.0")
    top_p: float | None = Field(None, description="nucleus mass in (0, 1]")
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="-1 or 0 disables")
    min_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, description="isolates this request's prefix-cache entries")
    logit_bias: dict[str, float] | None = None
    # structured output (api/structured.py): at most one of these
    response_format: dict | None = Field(None, description="{'type': 'text' | 'json_object' | 'json_schema', "
                                                            "'json_schema': {'name', 'schema', 'strict'}}")
    structured_outputs: object | None = Field(None, description="vLLM's: {json | regex | choice | grammar | json_object}")
    guided_json: object | None = Field(None, description="vLLM's older name of structured_outputs.json")
    guided_regex: object | None = Field(None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: object | None = Field(None, description="vLLM's older name of structured_outputs.choice")
    guided_grammar: object | None = Field(None, description="vLLM's older name of structured_outputs.grammar")
    # vLLM fields not built yet: declared so that a request setting one is refused (unsupported.REQUEST_REFUSALS),
    # never silently ignored
    bad_words: object | None = Field(None, description="refused: not supported yet")
    allowed_token_ids: object | None = Field(None, description="refused: not supported yet")
    logits_processors: object | None = Field(None, description="refused: not supported yet")
    truncate_prompt_tokens: object | None = Field(None, description="refused: not supported yet")
    use_beam_search: object | None = Field(None, description="refused: not supported yet")
    return_tokens_as_token_ids: object | None = Field(None, description="refused: not supported yet")


class CompletionRequest(_SamplingFields):
    """POST /v1/completions body. ``prompt``: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="null: up to max_model_len")
    logprobs: int | None = Field(None, description="top log-probabilities per token, 0..20")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True
    prompt_logprobs: int | None = None


class TextContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions body."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = Field(None, description="OpenAI function tools (api/tools.py)")
    tool_choice: str | dict | None = Field(None, description="none | auto | required | {type: function, function: {name}}")
    parallel_tool_calls: bool | None = None
    echo: object | None = Field(None, description="refused: not supported yet")
    prompt_logprobs: object | None = Field(None, description="refused: not supported yet")


class TokenizeRequest(_Request):
    """POST /tokenize: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="vLLM's: per prompt token (None for the first), {token_id: logprob, rank, decoded_token}")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict] = Field(default_factory=list, description="[{id, type: function, function: {name, arguments}}]")


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvfleet"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
