"""OpenAI tools on /v1/chat/completions (pure: request → tool mode, prompt and grammar; output → tool_calls).

``tool_choice`` (OpenAI's default with tools: "auto"):

- ``"none"``: plain text; the tools are still shown to the model (vLLM's default).
- ``"required"``: grammar-enforced JSON array of ``{"name", "arguments"}`` objects (vLLM's schema), each
  ``arguments`` valid against that function's ``parameters``; ``parallel_tool_calls: false`` → one call.
- ``{"type": "function", "function": {"name"}}``: the output is the named function's arguments, enforced
  by its ``parameters`` schema.
- ``"auto"``: free text, parsed by ``--tool-call-parser`` (api/tool_parser.py); needs
  ``--enable-auto-tool-choice`` and ``--tool-call-parser`` (else vLLM's 400).

Prompt: a chat template that mentions ``tools`` receives them (``apply_chat_template(tools=...)``); for a
template without a tools section (the bundled SmolLM2's) they are written into the system message in the
Hermes format (``TOOLS_SYSTEM_PROMPT``; docs/structured_output.md), and earlier assistant tool calls and
tool results are rendered as ``<tool_call>`` / ``<tool_response>`` text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from .structured import check_json_schema
from .tool_parser import END, START, ParsedCall, format_arguments

TOOLS_SYSTEM_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available tools: "
    "<tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How a chat request uses its tools.

    Attributes:
        mode: "none" | "auto" | "required" | "named".
        tools: the validated tool list (OpenAI shape), or [].
        name: the function of a named tool_choice.
        spec: the grammar of required / named calls.
    """

    mode: str
    tools: list[dict]
    name: str | None = None
    spec: StructuredOutputsParams | None = None


def _functions(tools) -> list[dict]:
    out, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidRequestError(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      param=f"tools.{i}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise InvalidRequestError(f"tools.{i}.function.name must be a string of 1 to 64 characters",
                                      param=f"tools.{i}.function.name")
        if name in names:
            raise InvalidRequestError(f"tools.{i}.function.name {name!r} is given twice", param=f"tools.{i}.function.name")
        names.add(name)
        params = fn.get("parameters")
        params = EMPTY_PARAMETERS if params is None else check_json_schema(params, f"tools.{i}.function.parameters")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def _array_schema(functions: list[dict], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": a non-empty array of {name, arguments} objects."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["function"]["name"]]},
                                              "arguments": f["function"]["parameters"]},
              "required": ["name", "arguments"]} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(body, enable_auto_tool_choice: bool, tool_parser: str | None) -> ToolPlan:
    """Validate ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request.

    Raises:
        InvalidRequestError: a malformed tool, a tool_choice naming an absent tool, required/named without
            tools, auto without the server flags (vLLM's message).
    """
    tools = _functions(body.tools) if body.tools else []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        match = [f for f in tools if f["function"]["name"] == name]
        if not match:
            raise InvalidRequestError(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
        spec = StructuredOutputsParams(json=match[0]["function"]["parameters"])
        return ToolPlan("named", tools, name, spec)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                                  param="tool_choice")
    if choice == "required":
        if not tools:
            raise InvalidRequestError('tool_choice "required" needs a non-empty tools list', param="tool_choice")
        parallel = body.parallel_tool_calls is not False
        return ToolPlan("required", tools, spec=StructuredOutputsParams(json=_array_schema(tools, parallel)))
    if choice == "auto" and tools and not (enable_auto_tool_choice and tool_parser):
        raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                                  param="tool_choice")
    return ToolPlan(choice if tools else "none", tools)


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tools_system_text(tools: list[dict]) -> str:
    return TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def inject_tools(messages: list[dict], tools: list[dict], raw_messages) -> list[dict]:
    """Messages for a template without a tools section: tools in the system message (prepended to one
    that exists), assistant tool calls and tool results as Hermes text."""
    out = []
    for m, raw in zip(messages, raw_messages):
        content = m["content"]
        if m["role"] == "assistant" and getattr(raw, "tool_calls", None):
            parts = [content] if content else []
            for tc in raw.tool_calls:
                fn = tc.get("function") if isinstance(tc, dict) else None
                fn = fn if isinstance(fn, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                parts.append(f"{START}\n{json.dumps({'name': fn.get('name'), 'arguments': args}, ensure_ascii=False)}"
                             f"\n{END}")
            content = "\n".join(parts)
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({**m, "content": content})
    if not tools:
        return out
    system = tools_system_text(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def calls_from_output(plan: ToolPlan, text: str, parser_cls=None) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output under ``plan``; an output that does not parse (cut by
    max_tokens) stays content with no calls."""
    if plan.mode == "named":
        return None, [ParsedCall(plan.name, text)]
    if plan.mode == "required":  # the complete {name, arguments} objects (all of them unless cut by max_tokens)
        calls = RequiredCallStreamer().feed(text)
        return (None if calls else text), calls
    if plan.mode == "auto" and parser_cls is not None:
        return parser_cls.extract(text)
    return text, []


class RequiredCallStreamer:
    """Incremental calls of a "required" output (a JSON array of {name, arguments}): each call is emitted
    once its object is complete, with the same ``format_arguments`` as the non-streamed response."""

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._obj_start = None

    def feed(self, delta: str) -> list[ParsedCall]:
        self._buf += delta
        calls = []
        i = self._pos
        while i < len(self._buf):
            ch = self._buf[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "[{":
                self._depth += 1
                if ch == "{" and self._depth == 2:
                    self._obj_start = i
            elif ch in "]}":
                if ch == "}" and self._depth == 2 and self._obj_start is not None:
                    try:
                        obj = json.loads(self._buf[self._obj_start: i + 1])
                        calls.append(ParsedCall(str(obj["name"]), format_arguments(obj["arguments"])))
                    except (ValueError, KeyError, TypeError):  # not a {name, arguments} object: not a call
                        pass
                    self._obj_start = None
                self._depth -= 1
            i += 1
        self._pos = i
        return calls


def call_dict(call: ParsedCall, call_id: str | None = None) -> dict:
    """OpenAI's ``tool_calls[i]`` of a response message."""
    return {"id": call_id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ChatToolStream:
    """Per-choice streaming of tool calls as OpenAI ``delta.tool_calls`` entries.

    ``feed(delta_text)`` → (content delta, tool-call deltas); named calls stream the generated text as
    argument deltas, required and auto calls are sent whole once parsed — in every mode the concatenated
    ``function.arguments`` equal the non-streamed response's.
    """

    def __init__(self, plan: ToolPlan, parser_cls=None):
        self.plan = plan
        self.num_calls = 0
        self._required = RequiredCallStreamer() if plan.mode == "required" else None
        self._parser = parser_cls() if plan.mode == "auto" and parser_cls is not None else None
        self._text = ""

    @property
    def active(self) -> bool:
        return self.plan.mode == "named" or self._required is not None or self._parser is not None

    def _whole(self, calls: list[ParsedCall]) -> list[dict]:
        out = []
        for c in calls:
            out.append({"index": self.num_calls, **call_dict(c)})
            self.num_calls += 1
        return out

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if self.plan.mode == "named":
            out = []
            if self.num_calls == 0:
                self.num_calls = 1
                out.append({"index": 0, "id": new_call_id(), "type": "function",
                            "function": {"name": self.plan.name, "arguments": ""}})
            if delta:
                out.append({"index": 0, "function": {"arguments": delta}})
            return "", out
        if self._required is not None:
            self._text += delta
            return "", self._whole(self._required.feed(delta))
        if self._parser is not None:
            content, calls = self._parser.feed(delta)
            return content, self._whole(calls)
        return delta, []

    def finish(self) -> str:
        """Content held back: the parser's unterminated block, or a required output without one complete call."""
        if self._required is not None:
            return self._text if not self.num_calls else ""
        return self._parser.finish()[0] if self._parser is not None else ""
