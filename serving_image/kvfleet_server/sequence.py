"""The step's shared types (mini-sglang's ``core.py``): a Request, its Sequences and their status, one
step's scheduled batch, and the content hash of a full KV block (prefix caching, KV events).

The bottom of the engine's layers: the scheduler, the runner, speculative decoding and the engine all
use these, and this module imports none of them.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from .outputs import PositionLogprobs, RequestMetrics
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from .spec_decode.gate import DraftGate


def hash_block_tokens(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra: tuple = ()) -> bytes:
    """Content hash of a full block: blake2b over (parent hash, extra keys, token ids).

    Extra keys (("salt", cache_salt), ("lora", adapter name, adapter id)) are length-prefixed UTF-8 so that no two different
    key tuples give the same bytes. Returns a 32-byte digest.
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(b"P" + (parent or b"\0" * 32))
    for key in extra:
        b = str(key).encode()
        h.update(b"E" + len(b).to_bytes(8, "little") + b)
    h.update(b"T" + len(token_ids).to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """One completion being generated (a request with n > 1 has n of them after its prompt prefill).

    Attributes:
        token_ids: prompt followed by generated tokens.
        num_computed_tokens: leading tokens whose K/V are in the cache.
        generator: this sequence's torch.Generator (seeded sampling survives preemption with it).
        block_hashes: chained hashes of its full blocks (prefix caching), computed lazily.
    """

    def __init__(self, request: "Request", index: int, token_ids: list[int], generator: torch.Generator | None):
        self.request = request
        self.index = index
        self.seq_id = f"{request.request_id}#{index}"
        self.order = next(_seq_counter)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SeqStatus.WAITING
        self.generator = generator
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[PositionLogprobs] | None = [] if request.params.logprobs is not None else None
        self.detok = None  # set by the engine (IncrementalDetokenizer)
        self.grammar = None  # structured output: sample.grammar.SequenceGrammar, set by the engine; kept on
        # preemption (recompute keeps token_ids, so the matcher state stays right)
        self.text = ""  # output text (stop string removed once matched)
        self.emitted_text_len = 0
        self.emitted_tokens = 0
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0
        self.num_draft_computed = 0  # leading positions whose draft-model KV is in the cache
        self.draft_gate: DraftGate | None = None  # set when the sequence is added to the scheduler

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_left(self) -> int:
        """Output tokens the sequence may still produce: the one room rule (length finish, jump-forward's
        budget, draft slots). ``LLMEngine.add_request`` caps max_tokens at max_model_len − prompt, so it also
        keeps prompt + output ≤ max_model_len."""
        return self.request.max_tokens - self.num_output_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def arrival_key(self) -> tuple[float, int]:
        return (self.request.arrival_time, self.request.order, self.index)

    def full_block_hashes(self, block_size: int, upto_blocks: int) -> list[bytes]:
        """Chained hashes of the first ``upto_blocks`` full blocks (extends the cached list)."""
        extra = self.request.hash_extra
        while len(self.block_hashes) < upto_blocks:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            toks = self.token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(hash_block_tokens(parent, toks, extra))
        return self.block_hashes[:upto_blocks]


_req_counter = itertools.count()


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs with (vLLM's ``LoRARequest``).

    Attributes:
        name: the name requests select it by (the OpenAI ``model`` field).
        lora_int_id: a positive id, never reused within a server's life (KV events' ``lora_id``).
        path: directory of the PEFT adapter (adapter_config.json + adapter_model.safetensors).
        base_model_name: what /v1/models reports as its ``parent`` (--lora-modules' JSON form; None: the
            served model name).
    """

    name: str
    lora_int_id: int
    path: str
    base_model_name: str | None = None


class Request:
    """What add_request received, plus its sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, max_tokens: int, cache_salt: str | None = None,
                 lora: LoRARequest | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.order = next(_req_counter)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.lora = lora
        # each key tagged by its source: a salt and an adapter name with the same text never collide; the
        # adapter's id too, so that a name loaded again from another path never reuses the old one's KV
        self.hash_extra: tuple = (() if cache_salt is None else ("salt", cache_salt)) + (
            () if lora is None else ("lora", lora.name, lora.lora_int_id))
        self.seqs: list[Sequence] = []
        self.forked = params.n == 1
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.aborted = False

    @property
    def finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.seqs)


@dataclass
class TokenSpan:
    """Tokens of one sequence to compute in a step: ``token_ids`` at positions [start, start + len),
    their KV slots addressed through ``block_table`` (a span longer than one token attends causally to
    its cached prefix: a prefill chunk, or a decode followed by its draft tokens).

    ``logits``: which rows' logits to compute with the step: "last" (the span samples its next token),
    "all" (every row verifies a draft) or None (none; ``compute_logits`` can still ask for any row).
    ``lora_slot``: the LoRA adapter slot its rows apply (−1: the base model)."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    logits: str | None = None
    lora_slot: int = -1


@dataclass
class ScheduledSeq:
    """One sequence's share of a step.

    Attributes:
        num_new: tokens computed this step: positions [num_computed, num_computed + num_new), the
            sequence's uncomputed tokens followed by its draft tokens.
        max_drafts: draft tokens the scheduler reserved KV slots for (speculative decoding).
        draft_ids: the proposed draft tokens (at most max_drafts; counted in num_new).
    """

    seq: Sequence
    num_new: int
    max_drafts: int = 0
    draft_ids: list[int] = field(default_factory=list)

    @property
    def num_known(self) -> int:
        """Tokens of this step that are already in the sequence (num_new without the drafts)."""
        return self.num_new - len(self.draft_ids)

    @property
    def samples(self) -> bool:
        return self.seq.num_computed_tokens + self.num_known == len(self.seq.token_ids)

    def input_ids(self) -> list[int]:
        p = self.seq.num_computed_tokens
        return self.seq.token_ids[p : p + self.num_known] + self.draft_ids

    def span(self, block_table: list[int], lora_slot: int = -1) -> TokenSpan:
        """This step's tokens as the runner computes them: logits with the step for every row of a
        drafted span (verification) or the last row of one that samples; ``lora_slot`` its adapter's slot."""
        logits = "all" if self.draft_ids else "last" if self.samples else None
        return TokenSpan(self.input_ids(), self.seq.num_computed_tokens, block_table, logits, lora_slot)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids: copy-on-write, partial hits
    pinned: list = field(default_factory=list)  # source blocks of partial hits: decref'd before the copies run, safe as nothing allocates in between
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)
