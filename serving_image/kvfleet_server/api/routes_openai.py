"""POST /v1/completions and /v1/chat/completions (streaming and not), OpenAI's shapes with vLLM's semantics.

Path of a request: validate body (pydantic) → model name → SamplingParams → admission (429/503) →
``AsyncEngine.add_many`` (engine refusals come back as 400) → stream SSE chunks or collect the final
outputs. Leaving early (client gone) closes the engine streams, which aborts the requests.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import EngineDeadError, InvalidRequestError
from ..outputs import RequestOutput
from .async_engine import RequestAborted
from .convert import (chat_logprobs, chat_messages, chat_sampling_params, check_text, check_token_ids,
                      completion_logprobs, completion_prompts, completion_sampling_params,
                      prompt_logprobs_entries)
from .errors import APIError, error_body
from .protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, CompletionChoice,
                       CompletionRequest, CompletionResponse, ErrorResponse, ResponseMessage, UsageInfo, now,
                       random_id)
from .streams import EngineStreamResponse, merge, sse, unless_disconnected
from .structured import compile_spec, structured_from_request
from .tool_parser import TOOL_PARSERS
from .tools import (ChatToolStream, ToolPlan, calls_from_output, call_dict, inject_tools, plan_tools,
                    template_supports_tools)

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}
router = APIRouter()


def _state(request: Request):
    return request.app.state.kv


def _vocab_size(llm) -> int | None:
    for obj, attr in ((llm, "vocab_size"), (getattr(llm, "tokenizer", None), "vocab_size")):
        v = getattr(obj, attr, None) if obj is not None else None
        if isinstance(v, int):
            return v
    return None


def _check_prompt(state, prompt, param: str = "prompt") -> None:
    if isinstance(prompt, str):
        check_text(prompt, param)
    else:
        check_token_ids(prompt, _vocab_size(state.llm), param)


def _usage(prompt_lens: list[int], completion_tokens: int) -> UsageInfo:
    p = sum(prompt_lens)
    return UsageInfo(prompt_tokens=p, completion_tokens=completion_tokens, total_tokens=p + completion_tokens)


async def _submit(state, prompts: list, params, cache_salt: str | None, prefix: str, add_special_tokens: bool = True,
                  lora=None):
    if params.stop:
        for s in params.stop:
            check_text(s, "stop")
    if cache_salt is not None:
        check_text(cache_salt, "cache_salt")
    engine = state.admit(len(prompts))
    rid = random_id(prefix)
    reqs = [(f"{rid}-{i}", p, dataclasses.replace(params), cache_salt) for i, p in enumerate(prompts)]
    return rid, await engine.add_many(reqs, add_special_tokens, lora_request=lora)


async def _constrain(state, body, plan: ToolPlan | None = None):
    """The request's compiled structured-output spec (response_format / structured_outputs / guided_* or the
    tool grammar of required / named tool_choice), or None."""
    try:
        spec, param = structured_from_request(body)
        if plan is not None and plan.spec is not None:
            if spec is not None:
                raise InvalidRequestError(f"{param.split('.')[0]} cannot be combined with tool_choice "
                                          f"{'required' if plan.mode == 'required' else 'naming a function'}",
                                          param=param.split(".")[0])
            spec, param = plan.spec, "tools"
    except InvalidRequestError:
        state.metrics.structured_output_rejected("invalid")
        raise
    if spec is None:
        return None
    await compile_spec(state.llm, spec, param, state.metrics)
    return spec


def _include_usage(body) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)


def _abort_error() -> APIError:
    return APIError(503, "the request was aborted: the server is shutting down", code="aborted")


# ------------------------------------------------------------------ /v1/completions


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def create_completion(body: CompletionRequest, request: Request):
    """OpenAI Completions; ``max_tokens`` null or absent means up to max_model_len (as vLLM)."""
    state = _state(request)
    lora = state.resolve_model(body.model)
    state.require_engine()
    prompts = completion_prompts(body.prompt)
    for p in prompts:
        _check_prompt(state, p)
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    params = completion_sampling_params(body, state.settings.max_logprobs, state.generation_defaults)
    params.structured_outputs = await _constrain(state, body)
    rid, streams = await _submit(state, prompts, params, body.cache_salt, "cmpl", body.add_special_tokens, lora)
    tok = state.llm.tokenizer
    prompt_texts = [p if isinstance(p, str) else None for p in prompts]

    def prompt_text(i: int, out: RequestOutput) -> str:
        if prompt_texts[i] is None:
            prompt_texts[i] = out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)
        return prompt_texts[i]

    k = body.logprobs
    piece = getattr(tok, "id_to_piece", None) or (lambda t: tok.decode([t]))
    model = lora.name if lora is not None else state.model_name
    created = now()

    if body.stream:
        async def gen():
            prompt_lens = [0] * len(prompts)
            gen_tokens: dict[int, int] = {}
            offsets: dict[int, int] = {}
            shifts: dict[int, int] = {}  # echo: prompt tokens' text length minus the prompt text's
            finished: set[int] = set()
            include_usage = _include_usage(body)
            try:
                try:
                    async for i, out in merge(streams):
                        prompt_lens[i] = len(out.prompt_token_ids)
                        for c in out.outputs:
                            idx = i * body.n + c.index
                            text, lp, plp = c.delta_text, None, None
                            if idx not in offsets:
                                offsets[idx] = 0
                                plp = _prompt_logprobs(body, out)
                                if body.echo:
                                    text = prompt_text(i, out) + text
                                    if k is not None and out.prompt_logprobs is not None:
                                        lp = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, k, 0, piece)
                                        shifts[idx] = _end(lp) - len(text) + len(c.delta_text)
                            if k is not None and c.delta_logprobs:
                                new = completion_logprobs(c.delta_token_ids, c.delta_logprobs, k,
                                                          offsets[idx] + (len(text) - len(c.delta_text))
                                                          + shifts.get(idx, 0))
                                lp = new if lp is None else _concat(lp, new)
                            gen_tokens[idx] = len(c.token_ids)
                            if not text and c.finish_reason is None and lp is None and plp is None:
                                continue
                            offsets[idx] += len(text)
                            if c.finish_reason is not None:
                                finished.add(idx)
                            choice = CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                                      stop_reason=c.stop_reason, prompt_logprobs=plp)
                            chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                     "choices": [choice.model_dump()]}
                            if include_usage:
                                chunk["usage"] = None
                            yield sse(chunk)
                except RequestAborted:
                    for idx in range(len(prompts) * body.n):
                        if idx not in finished:
                            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                       "choices": [{"index": idx, "text": "", "logprobs": None,
                                                    "finish_reason": "abort", "stop_reason": None}]})
                if include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": _usage(prompt_lens, sum(gen_tokens.values())).model_dump()})
            except EngineDeadError as exc:
                yield sse(error_body(503, f"the engine stopped: {exc}"))
            yield sse("[DONE]")

        return EngineStreamResponse(gen(), streams)

    async def collect():
        finals: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, out in merge(streams):
                finals[i] = out
        except RequestAborted:
            raise _abort_error() from None
        choices, completion_tokens = [], 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                text = c.text
                lp = None
                if body.echo:
                    text = prompt_text(i, out) + text
                if k is not None:
                    if body.echo and out.prompt_logprobs is not None:
                        head = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, k, 0, piece)
                        lp = _concat(head, completion_logprobs(c.token_ids, c.logprobs or [], k, _end(head)))
                    else:
                        lp = completion_logprobs(c.token_ids, c.logprobs or [], k,
                                                 len(prompt_text(i, out)) if body.echo else 0)
                completion_tokens += len(c.token_ids)
                choices.append(CompletionChoice(index=i * body.n + c.index, text=text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=_prompt_logprobs(body, out)))
        resp = CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=_usage([len(o.prompt_token_ids) for o in finals], completion_tokens))
        return JSONResponse(resp.model_dump())

    return await unless_disconnected(request, collect(), streams)


def _prompt_logprobs(body, out: RequestOutput):
    """The choice's ``prompt_logprobs`` when the request asked for them (not when only echo + logprobs did)."""
    if body.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    return prompt_logprobs_entries(out.prompt_logprobs)


def _end(lp) -> int:
    """text_offset just past the last token of a CompletionLogProbs (0 when empty)."""
    return lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0


def _concat(a, b):
    a.tokens += b.tokens
    a.token_logprobs += b.token_logprobs
    a.top_logprobs += b.top_logprobs
    a.text_offset += b.text_offset
    return a


# ------------------------------------------------------------------ /v1/chat/completions


def render_chat(state, body, plan: ToolPlan | None = None) -> str:
    """Apply the chat template (--chat-template, else the model's; InvalidRequestError with the template's
    message on a bad layout); tools go to the template, or into the system message for a template without a
    tools section."""
    messages = chat_messages(body.messages)
    tok = state.llm.tokenizer
    template = state.settings.chat_template or getattr(tok, "chat_template", None)
    kwargs = {"chat_template": state.settings.chat_template} if state.settings.chat_template else {}
    if template_supports_tools(template):
        for m, raw in zip(messages, body.messages):
            m.update({k: v for k, v in (("tool_calls", raw.tool_calls), ("tool_call_id", raw.tool_call_id)) if v})
        if plan is not None and plan.tools:
            kwargs["tools"] = plan.tools
    else:
        messages = inject_tools(messages, plan.tools if plan is not None else [], body.messages)
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                       tokenize=False, **kwargs)
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and friends: the template refused the layout
        raise InvalidRequestError(f"chat template error: {exc}", param="messages") from None


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """OpenAI Chat Completions with the model's chat template."""
    state = _state(request)
    lora = state.resolve_model(body.model)
    state.require_engine()
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    settings = state.settings
    plan = plan_tools(body, getattr(settings, "enable_auto_tool_choice", False),
                      getattr(settings, "tool_call_parser", None))
    parser_cls = TOOL_PARSERS.get(getattr(settings, "tool_call_parser", None) or "")
    params = chat_sampling_params(body, state.settings.max_logprobs, state.generation_defaults)
    params.structured_outputs = await _constrain(state, body, plan)
    prompt = render_chat(state, body, plan)
    # the chat template already wrote the special tokens (as vLLM: add_special_tokens=False for chat)
    try:
        rid, streams = await _submit(state, [prompt], params, body.cache_salt, "chatcmpl", False, lora)
    except InvalidRequestError as exc:  # the engine says max_tokens: name the field the request sent
        if exc.param == "max_tokens" and body.max_completion_tokens is not None:
            raise InvalidRequestError(exc.message.replace("max_tokens", "max_completion_tokens"),
                                      param="max_completion_tokens") from None
        raise
    k = (body.top_logprobs or 0) if body.logprobs else None
    model = lora.name if lora is not None else state.model_name
    created = now()

    if body.stream:
        async def gen():
            include_usage = _include_usage(body)
            prompt_len, gen_tokens, finished = 0, {}, set()

            def chunk(choices, usage=None, with_usage=False):
                c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": choices}
                if include_usage or with_usage:
                    c["usage"] = usage
                return sse(c)

            tool_streams = [ChatToolStream(plan, parser_cls) for _ in range(body.n)]
            try:
                for idx in range(body.n):
                    yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                try:
                    async for _, out in merge(streams):
                        prompt_len = len(out.prompt_token_ids)
                        for c in out.outputs:
                            gen_tokens[c.index] = len(c.token_ids)
                            lp = None
                            if k is not None and c.delta_logprobs:
                                lp = {"content": [e.model_dump() for e in
                                                  chat_logprobs(c.delta_token_ids, c.delta_logprobs, k)]}
                            ts = tool_streams[c.index]
                            text, calls = ts.feed(c.delta_text) if (c.delta_text or ts.active) else ("", [])
                            if c.finish_reason is not None:
                                text += ts.finish()
                            if not text and not calls and c.finish_reason is None and lp is None:
                                continue
                            delta = {"content": text} if text else {}
                            if calls:
                                delta["tool_calls"] = calls
                            reason = c.finish_reason
                            if c.finish_reason is not None:
                                finished.add(c.index)
                                if reason == "stop" and ts.num_calls:
                                    reason = "tool_calls"
                            yield chunk([{"index": c.index, "delta": delta, "logprobs": lp,
                                          "finish_reason": reason, "stop_reason": c.stop_reason}])
                except RequestAborted:
                    for idx in range(body.n):
                        if idx not in finished:
                            yield chunk([{"index": idx, "delta": {}, "logprobs": None, "finish_reason": "abort"}])
                if include_usage:
                    yield chunk([], _usage([prompt_len], sum(gen_tokens.values())).model_dump(), True)
            except EngineDeadError as exc:
                yield sse(error_body(503, f"the engine stopped: {exc}"))
            yield sse("[DONE]")

        return EngineStreamResponse(gen(), streams)

    async def collect():
        final = None
        try:
            async for _, out in merge(streams):
                final = out
        except RequestAborted:
            raise _abort_error() from None
        choices, completion_tokens = [], 0
        for c in final.outputs:
            lp = ChatLogprobs(content=chat_logprobs(c.token_ids, c.logprobs or [], k)) if k is not None else None
            completion_tokens += len(c.token_ids)
            content, calls = calls_from_output(plan, c.text, parser_cls)
            reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            message = ResponseMessage(content=content, tool_calls=[call_dict(t) for t in calls])
            choices.append(ChatChoice(index=c.index, message=message, logprobs=lp,
                                      finish_reason=reason, stop_reason=c.stop_reason))
        resp = ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=_usage([len(final.prompt_token_ids)], completion_tokens))
        return JSONResponse(resp.model_dump())

    return await unless_disconnected(request, collect(), streams)
