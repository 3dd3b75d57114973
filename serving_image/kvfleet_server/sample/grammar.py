"""Structured output: grammars enforced while decoding, through xgrammar (one small wrapper interface).

The grammar engine is xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation
Engine for Large Language Models", 2024): a pushdown automaton over the tokenizer's vocabulary with a
per-state cache of context-independent tokens, so that a per-step token bitmask is cheap.

- ``GrammarCompiler`` (one per engine): ``StructuredOutputsParams`` → xgrammar ``CompiledGrammar``
  (xgrammar's compiler with its cache), synchronously or on its own thread pool (``submit``) so the
  server compiles off the engine thread and bounds the wait with a timeout.
- ``SequenceGrammar`` (one per sequence): the xgrammar ``GrammarMatcher`` — bitmask fill, accept,
  rollback, termination, the forced continuation (jump-forward) and ``fork`` for n > 1.
- ``allocate_bitmask`` / ``apply_bitmask``: the batched mask the sampler applies to the logits.

What xgrammar refuses (a regex lookahead, bad EBNF) or would accept without enforcing (``not``,
``uniqueItems``, ``multipleOf``, ...) is refused (HTTP 400) naming the field, the feature and xgrammar's
message: there is no second grammar engine to fall back to (decided in docs/structured_output.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import re
import threading
import time

import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams

#: JSON whitespace allowed between two tokens of a JSON document (xgrammar's max_whitespace_cnt): a
#: small model otherwise emits newlines until max_tokens inside an object (vLLM issue #38696).
DEFAULT_MAX_WHITESPACE = 2
DEFAULT_COMPILE_THREADS = 2

# Schema keywords xgrammar 0.2 ignores silently instead of enforcing: refused by name, so that a
# response never claims to validate against a schema whose constraint was dropped.
# (checked against xgrammar 0.2.9: multipleOf, patternProperties, propertyNames and unevaluatedProperties
# are enforced; these are not)
_UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                        "uniqueItems", "contains", "minContains", "maxContains")


class UnsupportedGrammarFeature(InvalidRequestError):
    """The spec uses a feature the grammar engine refuses or cannot enforce (HTTP 400, ``param`` = the field)."""


def _xgr():
    import xgrammar

    return xgrammar


def find_unenforced_keyword(schema, path: str = "") -> str | None:
    """First schema keyword (as ``path.keyword``) that the grammar would not enforce, or None.

    Walks every subschema (properties, items, anyOf/oneOf/allOf, $defs, additionalProperties, ...).
    """
    if isinstance(schema, dict):
        for kw in _UNENFORCED_KEYWORDS:
            if kw in schema and not (kw == "uniqueItems" and schema[kw] is False):
                return f"{path}{kw}"
        for key, value in schema.items():
            if key in ("enum", "const", "default", "examples", "description", "title"):
                continue
            if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                for name, sub in value.items():
                    found = find_unenforced_keyword(sub, f"{path}{key}.{name}.")
                    if found:
                        return found
            elif isinstance(value, (dict, list)):
                found = find_unenforced_keyword(value, f"{path}{key}.")
                if found:
                    return found
    elif isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = find_unenforced_keyword(sub, f"{path}{i}.")
            if found:
                return found
    return None


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer (xgrammar ``GrammarCompiler`` with its cache).

    Args:
        hf_tokenizer: the transformers tokenizer (xgrammar reads its vocabulary and decoder).
        vocab_size: the model's logits width (may exceed the tokenizer's length: padded embeddings).
        stop_token_ids: EOS ids: accepted only where the grammar can terminate.
        any_whitespace: JSON may hold whitespace between tokens (capped by ``max_whitespace``); False: one
            fixed layout (``{"a": 1, "b": [2, 3]}``), which also gives jump-forward long forced strings.
        max_whitespace: JSON whitespace cap between tokens (None: unlimited).
        num_threads: threads of the compile pool (``submit``).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], any_whitespace: bool = True,
                 max_whitespace: int | None = DEFAULT_MAX_WHITESPACE, num_threads: int = DEFAULT_COMPILE_THREADS):
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.max_whitespace = max_whitespace
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=True)
        # daemon threads (not a ThreadPoolExecutor, whose workers are joined at exit): a pathological compile
        # that outlived its request's timeout must not hold up the server's shutdown
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(num_threads):
            threading.Thread(target=self._work, name=f"kvfleet-grammar-{i}", daemon=True).start()

    def compile(self, spec: StructuredOutputsParams, param: str | None = None):
        """Compile ``spec`` (blocking) and store the result in ``spec.compiled``; returns it.

        ``param``: the request field the spec came from, named in errors (default ``structured_outputs.<kind>``).

        Raises:
            InvalidRequestError: malformed JSON schema text, regex or EBNF (param names the field).
            UnsupportedGrammarFeature: a schema keyword the grammar would not enforce, or a feature xgrammar refuses.
        """
        if spec.compiled is not None:
            return spec.compiled
        kind = spec.kind
        field = param or f"structured_outputs.{kind}"
        c = self._compiler
        try:
            if kind == "json":
                schema = spec.json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as exc:
                        raise InvalidRequestError(f"{field} is not valid JSON: {exc}", param=field) from None
                bad = find_unenforced_keyword(schema)
                if bad is not None:
                    raise UnsupportedGrammarFeature(
                        f"not supported: JSON Schema keyword {bad.rsplit('.', 1)[-1]!r} at {field}.{bad} "
                        "(the grammar engine cannot enforce it)", param=field)
                compiled = c.compile_json_schema(json.dumps(schema), **self._json_layout(), strict_mode=True)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', **self._json_layout(), strict_mode=False)
            elif kind == "regex":
                compiled = c.compile_regex(spec.regex)
            elif kind == "choice":
                ebnf = "root ::= " + " | ".join(json.dumps(ch, ensure_ascii=False) for ch in spec.choice)
                compiled = c.compile_grammar(ebnf)
            else:
                compiled = c.compile_grammar(spec.grammar)
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its parser's message
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            msg = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", msg)  # xgrammar's "[time] file.cc:94: " prefix
            if "not supported" in msg.lower() or "unsupported" in msg.lower():
                raise UnsupportedGrammarFeature(f"not supported: {field}: {msg}", param=field) from None
            raise InvalidRequestError(f"{field} could not be compiled: {msg}", param=field) from None
        spec.compiled = compiled
        return compiled

    def _json_layout(self) -> dict:
        if self.any_whitespace:
            return {"any_whitespace": True, "max_whitespace_cnt": self.max_whitespace}
        return {"any_whitespace": False, "separators": (", ", ": ")}

    def submit(self, spec: StructuredOutputsParams, param: str | None = None) -> concurrent.futures.Future:
        """Compile on the pool; the future's result is ``(compiled grammar, seconds)``. A compile that outlives
        the caller's timeout keeps its pool thread until xgrammar returns (it cannot be interrupted)."""

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, spec, param))
        return fut

    def _work(self) -> None:
        while True:
            fut, spec, param = self._jobs.get()
            if not fut.set_running_or_notify_cancel():  # the waiter timed out while this was queued
                continue
            t0 = time.perf_counter()
            try:
                out = self.compile(spec, param)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
            else:
                fut.set_result((out, time.perf_counter() - t0))


class SequenceGrammar:
    """The structured-output state of one sequence (an xgrammar ``GrammarMatcher``): the next token's mask
    (``fill_bitmask``, batched by ``grammar_bitmask``), a sampled token's acceptance with SGLang's jump-forward
    (``advance``), the state of each of n samples (``fork``) and rollback.

    Args:
        compiled: xgrammar ``CompiledGrammar``.
        stop_token_ids: tokens that end the sequence (EOS + the request's stop_token_ids); the grammar
            allows them only where it can terminate.
    """

    def __init__(self, compiled, stop_token_ids: list[int], _matcher=None):
        self.compiled = compiled
        self.stop_token_ids = list(stop_token_ids)
        self.matcher = _matcher if _matcher is not None else _xgr().GrammarMatcher(
            compiled, override_stop_tokens=self.stop_token_ids)
        self.num_accepted = 0

    def fork(self) -> "SequenceGrammar":
        """An independent copy at the same state (n > 1: each sample continues on its own)."""
        g = SequenceGrammar(self.compiled, self.stop_token_ids, self.matcher.fork())
        g.num_accepted = self.num_accepted
        return g

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 [B, ceil(V / 32)], bit set = allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        ok = self.matcher.accept_token(int(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def advance(self, token_id: int, tokenizer, output_ids: list[int], budget: int, jump_forward: bool
                ) -> tuple[list[int] | None, bool]:
        """Accept the token just sampled (the last of ``output_ids``), then, with ``jump_forward``, the text
        the grammar forces after it (``jump_forward.plan_jump_forward``, at most ``budget`` tokens in all).

        Returns (the tokens that replace the sampled one — itself, or the jump-forward plan starting with
        its retokenized replacement — or None when the grammar does not allow it (the sampler's bitmask
        rules that out), and whether the grammar has terminated: nothing may follow).
        """
        if not self.accept(token_id):
            return None, False
        if jump_forward and not self.is_terminated:
            from .jump_forward import plan_jump_forward

            plan = plan_jump_forward(self, tokenizer, output_ids, budget)
            if plan is not None:
                return plan, self.is_terminated
        return [token_id], self.is_terminated

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete match (EOS would be accepted here)."""
        return self.matcher.is_completed()

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def forced_continuation(self) -> str:
        """The text every continuation must start with (empty when the next token is a real choice)."""
        return self.matcher.find_jump_forward_string()


def grammar_bitmask(grammars: list[SequenceGrammar | None], vocab_size: int
                    ) -> tuple[torch.Tensor, list[int]] | None:
    """The batch's mask: (int32 bitmask [len(grammars), ceil(vocab_size / 32)], rows under a grammar), or
    None when no row has one. Rows without a grammar allow every token."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    bitmask = allocate_bitmask(len(grammars), vocab_size)
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    return bitmask, rows


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, ceil(vocab_size / 32)], every token allowed."""
    return _xgr().allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set disallowed tokens of ``logits[rows]`` to -inf in place. logits: [N, V] float; bitmask rows
    are indexed like the logits rows."""
    if logits.device.type != "cpu" and bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    _xgr().apply_token_bitmask_inplace(logits, bitmask, indices=rows)
