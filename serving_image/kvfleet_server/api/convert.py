"""Pure conversions between the OpenAI request/response shapes and the engine's types (no I/O).

- request → ``SamplingParams`` (vLLM's meaning for every field; unbuilt fields refused; the structured-output
  spec is added by the route once compiled);
- engine ``PositionLogprobs`` → OpenAI's legacy completion logprobs and chat logprobs;
- prompt forms of /v1/completions → a list of engine prompts.
"""

from __future__ import annotations

from ..errors import InvalidRequestError, UnsupportedFeatureError
from ..generation_config import GenerationDefaults
from ..outputs import Logprob, PositionLogprobs
from ..sampling_params import SamplingParams
from ..unsupported import CHAT, COMPLETIONS, request_refusals
from .protocol import (ChatCompletionRequest, ChatMessage, ChatTokenLogprob, CompletionLogProbs,
                       CompletionRequest, PromptLogprob, TopLogprob)

MIN_TEMPERATURE = 1e-2  # below this (and above 0), sampling is numerically unstable: clamp like vLLM


def refuse_unbuilt(req, endpoint: str) -> None:
    """UnsupportedFeatureError (param = the field) for the first field the request sent that hits
    ``unsupported.REQUEST_REFUSALS``."""
    refused = request_refusals(endpoint, {name: getattr(req, name) for name in req.model_fields_set})
    if refused:
        raise UnsupportedFeatureError(refused[0].message(), param=refused[0].field)


def check_logprobs(value: int | None, param: str, max_logprobs: int) -> None:
    """InvalidRequestError when more log-probabilities than ``--max-logprobs`` (-1: no limit) are asked for."""
    if value is not None and max_logprobs >= 0 and value > max_logprobs:
        raise InvalidRequestError(f"{param} must be at most {max_logprobs} (the server's --max-logprobs), got {value}",
                                  param=param)


#: request field → its value when neither the request nor the generation config sets it (vLLM's)
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def _common(req, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
            defaults: GenerationDefaults) -> SamplingParams:
    """The fields both endpoints share; a field the request leaves unset (None) takes the model's
    generation-config default (``defaults``), else vLLM's neutral value."""
    knobs = {name: getattr(req, name) if getattr(req, name) is not None else defaults.params.get(name, neutral)
             for name, neutral in NEUTRAL.items()}
    if 0.0 < knobs["temperature"] < MIN_TEMPERATURE:
        knobs["temperature"] = MIN_TEMPERATURE
    return SamplingParams(
        n=req.n,
        **knobs,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        max_tokens=defaults.resolve_max_tokens(max_tokens),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )


def completion_sampling_params(req: CompletionRequest, max_logprobs: int = 20,
                               defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
    """SamplingParams for /v1/completions; ``echo`` with ``logprobs`` also asks for prompt logprobs;
    ``defaults``: the model's generation-config defaults for fields the request leaves unset."""
    refuse_unbuilt(req, COMPLETIONS)
    check_logprobs(req.logprobs, "logprobs", max_logprobs)
    check_logprobs(req.prompt_logprobs, "prompt_logprobs", max_logprobs)
    if req.best_of is not None and req.best_of != req.n:
        raise UnsupportedFeatureError(f"not supported yet: best_of different from n (best_of={req.best_of}, n={req.n})",
                                      param="best_of")
    if req.max_tokens is not None and req.max_tokens < (0 if req.echo else 1):
        raise InvalidRequestError(
            f"max_tokens must be at least 1 (0 only with echo: true, to score the prompt), got {req.max_tokens}",
            param="max_tokens")
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs if prompt_logprobs is None else max(prompt_logprobs, req.logprobs)
    return _common(req, req.max_tokens, req.logprobs, prompt_logprobs, defaults)


def chat_sampling_params(req: ChatCompletionRequest, max_logprobs: int = 20,
                         defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
    """SamplingParams for /v1/chat/completions (``logprobs: true`` alone means the chosen token only;
    ``defaults``: the model's generation-config defaults for fields the request leaves unset).
    Tools and structured output are added by the route (api/tools.py, api/structured.py)."""
    refuse_unbuilt(req, CHAT)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise InvalidRequestError(f"top_logprobs must be non-negative, got {req.top_logprobs}", param="top_logprobs")
    check_logprobs(req.top_logprobs, "top_logprobs", max_logprobs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {max_tokens}", param=param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return _common(req, max_tokens, logprobs, None, defaults)


def completion_prompts(prompt) -> list[str | list[int]]:
    """Normalise /v1/completions' ``prompt``: str | list[str] | list[int] | list[list[int]] → engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        if any(len(p) == 0 for p in prompt):
            raise InvalidRequestError("prompt token-id lists must not be empty", param="prompt")
        return [list(p) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of strings, token ids or lists of token ids",
                              param="prompt")


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    """Raise InvalidRequestError if a token id is outside [0, vocab_size)."""
    for t in ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise InvalidRequestError(f"{param} holds token id {t} outside the vocabulary [0, {vocab_size})",
                                      param=param)


def check_text(text: str, param: str) -> None:
    """Refuse strings that cannot be UTF-8 encoded (lone surrogates from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"{param} is not valid Unicode text: {exc.reason}", param=param) from None


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI chat messages → ``[{"role", "content": str}]`` for the chat template (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise UnsupportedFeatureError(f"not supported yet: content part of type {part.type!r} "
                                                  f"(messages.{i}.content.{j})")
                if part.text is None:
                    raise InvalidRequestError(f"messages.{i}.content.{j}.text is required for a text part",
                                              param=f"messages.{i}.content.{j}.text")
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            content = m.content or ""
        check_text(content, f"messages.{i}.content")
        out.append({"role": m.role, "content": content})
    return out


# ------------------------------------------------------------------ logprobs


def _chosen(pos: PositionLogprobs, token_id: int) -> Logprob:
    lp = pos.get(token_id)
    if lp is None:  # engines always include the chosen token; be robust anyway
        lp = Logprob(token_id=token_id, logprob=float("-inf"), decoded="")
    return lp


def _top(pos: PositionLogprobs, k: int) -> list[Logprob]:
    return sorted(pos.values(), key=lambda lp: -lp.logprob)[:k]


def _finite(x: float) -> float:
    return x if x > -1e30 else -9999.0  # JSON has no -inf; OpenAI clients expect a number


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], k: int,
                        text_offset: int = 0, token_text=None) -> CompletionLogProbs:
    """OpenAI legacy ``logprobs`` for /v1/completions.

    Args:
        token_ids: the tokens (prompt tokens for echo, then generated ones).
        positions: per token, the engine's PositionLogprobs (None for the first prompt token).
        k: how many top alternatives to list per position (the chosen token is always listed too).
        text_offset: character offset of the first token in the returned text.
        token_text: ``id -> str`` for positions without logprobs (the first prompt token under echo).
    """
    out = CompletionLogProbs()
    offset = text_offset
    for tid, pos in zip(token_ids, positions):
        if pos is None:
            text = token_text(tid) if token_text is not None else ""
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        lp = _chosen(pos, tid)
        out.tokens.append(lp.decoded)
        out.token_logprobs.append(_finite(lp.logprob))
        top = {t.decoded: _finite(t.logprob) for t in _top(pos, k)}
        top.setdefault(lp.decoded, _finite(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(lp.decoded)
    return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> list[ChatTokenLogprob]:
    """OpenAI chat ``logprobs.content`` entries: chosen token, its logprob and bytes, and the top k."""
    out = []
    for tid, pos in zip(token_ids, positions):
        lp = _chosen(pos, tid)
        out.append(ChatTokenLogprob(
            token=lp.decoded, logprob=_finite(lp.logprob), bytes=list(lp.decoded.encode("utf-8", "replace")),
            top_logprobs=[TopLogprob(token=t.decoded, logprob=_finite(t.logprob),
                                     bytes=list(t.decoded.encode("utf-8", "replace"))) for t in _top(pos, k)]))
    return out


def prompt_logprobs_entries(positions: list[PositionLogprobs | None]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``choices[i].prompt_logprobs``: per prompt token, None for the first (nothing precedes it), else
    ``{str(token_id): {logprob, rank, decoded_token}}`` for the prompt token and the top alternatives."""
    return [None if pos is None else
            {str(tid): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded)
             for tid, lp in pos.items()}
            for pos in positions]
