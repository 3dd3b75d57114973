"""Tool-call parsers for ``tool_choice: "auto"`` (pure: text in, content and calls out).

``hermes``: the Hermes / Qwen format (NousResearch Hermes-2-Pro function calling, vLLM's
``--tool-call-parser hermes``): each call is a JSON object ``{"name": ..., "arguments": {...}}``
between ``<tool_call>`` and ``</tool_call>``; text before the first call is the message content.

Both the whole-text parser and the streaming one build a call's ``arguments`` string with the same
function (``format_arguments``), so streamed argument deltas concatenate to exactly the non-streamed
arguments. A block that is not a JSON object with a string ``name`` is left in the content as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

START, END = "<tool_call>", "</tool_call>"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, serialized by format_arguments (or the model's own text, named calls)


def format_arguments(args) -> str:
    """The ``function.arguments`` string of a parsed call: compact-free JSON as json.dumps writes it."""
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def _parse_block(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], format_arguments(args))


class HermesToolParser:
    """Whole-text and incremental parsing of ``<tool_call>{...}</tool_call>`` blocks.

    Incremental use: ``feed(delta)`` per text delta returns ``(content_delta, new_calls)``; ``finish()``
    flushes what is held back (an unterminated block becomes content). ``extract(text)`` gives the same
    calls for the whole text at once.
    """

    name = "hermes"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._seen_call = False

    @staticmethod
    def extract(text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content or None, calls) of a whole model output."""
        p = HermesToolParser()
        content, calls = p.feed(text)
        more, rest = p.finish()
        content += more
        calls += rest
        return (content if content.strip() or not calls else None), calls

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buf += delta
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buf.find(END)
                if end < 0:
                    return content, calls
                body, self._buf = self._buf[:end], self._buf[end + len(END):]
                self._in_call = False
                call = _parse_block(body)
                if call is None:
                    content += START + body + END
                else:
                    calls.append(call)
                    self._seen_call = True
                continue
            start = self._buf.find(START)
            if start < 0:
                keep = _partial_suffix(self._buf, START)
                text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                content += self._content(text)
                return content, calls
            content += self._content(self._buf[:start])
            self._buf = self._buf[start + len(START):]
            self._in_call = True

    def _content(self, text: str) -> str:
        # whitespace between two calls is not content
        return text if not self._seen_call or text.strip() else ""

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest = (START + self._buf) if self._in_call else self._buf
        self._buf, self._in_call = "", False
        return self._content(rest), []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


TOOL_PARSERS = {"hermes": HermesToolParser}
