"""A tiny deterministic stand-in for LLMEngine, for HTTP-layer unit tests only (never shipped).

Byte-level tokenizer (ids 0..255 are bytes, 256 is EOS); every running request emits the next
character of "hello world " per step; stop strings, max_tokens, n and logprobs are honoured in the
simplest way. Real-engine behaviour is covered by the subprocess tests.
"""

from __future__ import annotations

import math
import time

from kvfleet_server.errors import InvalidRequestError, PromptTooLongError
from kvfleet_server.generation_config import GenerationDefaults
from kvfleet_server.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet_server.stats import IterationStats, SchedulerStats

TEXT = "hello world "


class ByteTokenizer:
    eos_token_id = 256
    vocab_size = 257

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        if messages[0]["role"] == "system" and len(messages) == 1:
            raise InvalidRequestError("Conversation must contain a user message", param="messages")
        s = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return s + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    def __init__(self, max_model_len=256, max_num_seqs=4, num_blocks=32, block_size=16, step_delay=0.0,
                 text=TEXT):
        self.step_delay = step_delay
        self.text = text  # what every request emits, one character per step (cycled)
        self.tokenizer = ByteTokenizer()
        self.generation_defaults = GenerationDefaults()  # --generation-config vllm
        self.max_model_len = max_model_len
        self.model_name = "fake"
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.waiting: list[dict] = []
        self.running: list[dict] = []
        self.last_iteration = IterationStats()
        self.aborted: list[str] = []

    def get_lora(self, name):
        return None  # the fake engine serves no adapters

    def list_loras(self):
        return []

    def add_request(self, request_id, prompt, params, arrival_time=None, cache_salt=None, add_special_tokens=True,
                    lora_request=None):
        assert lora_request is None, "the fake engine serves no adapters"
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        if len(ids) + max_tokens > self.max_model_len:
            raise PromptTooLongError(f"prompt ({len(ids)}) + max_tokens ({max_tokens}) > max_model_len "
                                     f"({self.max_model_len})", param="max_tokens")
        outs = [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self.waiting.append({"id": request_id, "prompt": prompt if isinstance(prompt, str) else None, "ids": ids,
                             "params": params, "max_tokens": max_tokens, "outs": outs, "new": True})

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.waiting = [r for r in self.waiting if r["id"] != request_id]
        self.running = [r for r in self.running if r["id"] != request_id]

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def _blocks(self, r):
        return math.ceil((len(r["ids"]) + max(len(o.token_ids) for o in r["outs"]) + 1) / self.block_size)

    def get_stats(self):
        used = sum(self._blocks(r) for r in self.running)
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              kv_cache_usage=used / self.num_blocks, num_blocks_total=self.num_blocks,
                              num_blocks_free=self.num_blocks - used)

    def step(self):
        if self.step_delay:
            time.sleep(self.step_delay)
        it = IterationStats()
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            it.num_prompt_tokens += len(r["ids"])
            self.running.append(r)
        results = []
        for r in list(self.running):
            p = r["params"]
            for o in r["outs"]:
                o.delta_text, o.delta_token_ids = "", []
                o.delta_logprobs = [] if p.logprobs is not None else None
                if o.finished:
                    continue
                ch = self.text[len(o.token_ids) % len(self.text)]
                tid = ord(ch)
                o.token_ids.append(tid)
                it.num_generation_tokens += 1
                if p.logprobs is not None:
                    lp = {tid: Logprob(tid, -0.5, ch, 1)}
                    for j in range(p.logprobs):
                        alt = ord("a") + j
                        lp.setdefault(alt, Logprob(alt, -2.0 - j, chr(alt), j + 2))
                    o.logprobs.append(lp)
                    o.delta_logprobs.append(lp)
                o.delta_token_ids = [tid]
                o.text += ch
                o.delta_text = ch
                for s in p.stop:
                    if s in o.text:
                        o.text = o.text[: o.text.index(s)]
                        o.delta_text = ""
                        o.finish_reason, o.stop_reason = "stop", s
                if o.finish_reason is None and len(o.token_ids) >= r["max_tokens"]:
                    o.finish_reason = "length"
            done = all(o.finished for o in r["outs"])
            results.append(RequestOutput(request_id=r["id"], prompt=r["prompt"], prompt_token_ids=r["ids"],
                                         outputs=[CompletionOutput(**vars(o)) for o in r["outs"]], finished=done))
            if done:
                self.running.remove(r)
        self.last_iteration = it
        return results
