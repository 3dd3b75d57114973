"""Continuous-batching scheduler with chunked prefill, recompute preemption and prefix-cache lookup.

Every step (after vLLM v1's unified scheduler) each sequence simply has tokens whose KV is not in
the cache yet: ``len(token_ids) - num_computed_tokens`` — the whole prompt for a new request, one
token for a decode, prompt + generated tokens after a preemption. The scheduler hands out a token
budget (``max_num_batched_tokens``) per step:

1. running sequences first, oldest arrival first (decodes take 1 token, unfinished prefills a chunk);
   when the pool cannot supply a block, the most recently arrived running sequence is preempted
   (blocks freed, requeued at the front of the waiting queue, recomputed later);
2. then waiting sequences in order, as long as budget, ``max_num_seqs`` and free blocks allow
   (a waiting sequence never preempts a running one).

A sequence samples a token in a step when that step computes its last known token.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from .kv_cache import KVCacheManager, hash_block_tokens
from ..outputs import PositionLogprobs, RequestMetrics
from ..sampling_params import SamplingParams


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


class DraftGate:
    """Acceptance-based cut-off of speculation for one sequence (speculative decoding).

    Speculating pays when the fraction a of drafts accepted beats the break-even rate
    ``min_acceptance`` = draft_cost + verify_cost: a step with k drafts emits 1 + a·k tokens for about
    1 + k·(draft_cost + verify_cost) decode steps' worth of time (proposing a draft, and one more row
    in the target's pass, each relative to a decode step; ``spec_decode.draft_cost``, ``VERIFY_COST``).
    The gate tracks an exponential moving average of a; when it falls below ``min_acceptance`` (the
    engine passes the break-even, at least ``MIN_ACCEPTANCE``, or speculative_config.min_acceptance;
    0 never cuts off; at 1 or more the engine does not speculate at all) the sequence decodes without
    drafts for a back-off (8 steps, or more for a costly draft: at least ``token_cost / PROBE_OVERHEAD``
    steps, so failed probes cost at most 4 % of the decode steps; doubling after every failed probe up to
    256), then probes with a single draft (a new sequence starts with a probe too while the acceptance
    over all sequences is below the cut-off, and starts from the back-off the last failed verification
    reached, at most ``MAX_INHERITED_BACKOFF`` or the first back-off if larger: with a draft that never
    agrees, a request of up to 64 tokens costs one probe, not one per doubling; any verification that pays resets what new sequences inherit, so acceptance that
    recovers is picked up within 64 steps). A probe that pays brings k drafts back; the back-off resets only once a full
    verification pays. A sequence the proposer cannot predict costs almost nothing after a few steps, one
    that starts quoting its prompt is picked up again. The output distribution does not depend on when
    drafts are used (verification is lossless either way).

    Draft length: while open, a sequence verifies the γ ≤ k drafts that maximise the expected speed-up
    (1 − α^(γ+1)) / ((1 − α)(1 + γ·c)) (Leviathan et al. 2023, §3.3 "optimal γ"), where α is the
    sequence's per-position acceptance (discounted successes / trials: after a verification of γ drafts
    with a accepted, a successes and one failure when a < γ; prior 3 of 4) and c = ``token_cost``, the
    cost of one more draft token relative to a decode step (the break-even above). A verbatim copy
    (α → 1) grows to k within two verifications; text the drafts miss shrinks to one or two drafts before
    the cut-off closes. ``token_cost`` 0 keeps γ = k.
    """

    #: floor of the computed cut-off: 1.5x the CPU break-even of n-gram drafts (0.1). It was 0.3, which
    #: closed the gate on copies that paid (benchmarks/spec_gate_replay.py; docs/spec_decode.md, "Cut-off
    #: floor 0.15")
    MIN_ACCEPTANCE = 0.15
    FIRST_BACKOFF, MAX_BACKOFF = 8, 256
    MAX_INHERITED_BACKOFF = 64
    #: the share of decode steps that failed probes may cost (sets the first back-off of a costly draft)
    PROBE_OVERHEAD = 0.04

    #: discount of earlier verifications in the acceptance estimate α, and its prior (successes, failures)
    DISCOUNT, PRIOR = 0.7, (3.0, 1.0)

    def __init__(self, min_acceptance: float = MIN_ACCEPTANCE, probing: bool = False, backoff: int | None = None,
                 token_cost: float = 0.0):
        self.min_acceptance = min_acceptance
        self.ema = min_acceptance  # a first verification that accepts little already cuts off
        self.token_cost = token_cost
        self.backoff = self.first_backoff if backoff is None else backoff
        self.resume_step = 0
        self.probing = probing  # the next verification checks a single draft
        self.successes, self.failures = self.PRIOR

    @classmethod
    def cut_off(cls, break_even: float, floor: float | None = None) -> float:
        """The computed cut-off: the break-even acceptance, at least ``floor`` (``MIN_ACCEPTANCE``)."""
        return max(cls.MIN_ACCEPTANCE if floor is None else floor, break_even)

    @classmethod
    def initial_backoff(cls, token_cost: float) -> int:
        """Steps without drafts after a first failed verification: ``FIRST_BACKOFF``, or enough that a failed
        one-draft probe (``token_cost`` of a decode step) costs at most ``PROBE_OVERHEAD`` of the steps."""
        return max(cls.FIRST_BACKOFF, math.ceil(token_cost / cls.PROBE_OVERHEAD))

    @classmethod
    def max_inherited_backoff(cls, token_cost: float) -> int:
        return max(cls.MAX_INHERITED_BACKOFF, cls.initial_backoff(token_cost))

    @property
    def first_backoff(self) -> int:
        return self.initial_backoff(self.token_cost)

    def open(self, step: int) -> bool:
        return step >= self.resume_step

    @property
    def alpha(self) -> float:
        """Estimated probability that the next draft is accepted given the previous one was."""
        return self.successes / (self.successes + self.failures)

    def num_drafts(self, k: int) -> int:
        """Drafts to verify when open: 1 for a probe, else the γ in [1, k] of the best expected speed-up."""
        if self.probing:
            return min(k, 1)
        c = self.token_cost
        if c <= 0:
            return k
        a = min(self.alpha, 1 - 1e-6)
        return max(range(1, k + 1), key=lambda g: (1 - a ** (g + 1)) / ((1 - a) * (1 + g * c)), default=0)

    def update(self, step: int, num_drafts: int, num_accepted: int) -> None:
        d = self.DISCOUNT
        self.successes = d * self.successes + num_accepted
        self.failures = d * self.failures + (num_accepted < num_drafts)
        self.ema = 0.5 * self.ema + 0.5 * num_accepted / num_drafts
        if self.ema >= self.min_acceptance:
            if not self.probing:
                self.backoff = self.first_backoff
            self.probing = False
            return
        self.resume_step = step + self.backoff
        self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
        self.ema = self.min_acceptance  # the probe after the back-off decides alone
        self.probing = True


_req_counter = itertools.count()


class Request:
    """What add_request received, plus its sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, max_tokens: int, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.order = next(_req_counter)
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.hash_extra: tuple = () if cache_salt is None else ("salt", cache_salt)
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


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids: copy-on-write, partial hits
    pinned: list = field(default_factory=list)  # source blocks of partial hits, released after the copies
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    """Decides, each step, which sequences compute how many tokens (see module docstring)."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool, partial_block_matching: bool = True,
                 num_speculative_tokens: int = 0, disable_by_batch_size: int | None = None,
                 max_model_len: int = 1 << 62, spec_min_acceptance: float = DraftGate.MIN_ACCEPTANCE,
                 spec_token_cost: float = 0.0):
        self.kv = kv
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.partial_block_matching = partial_block_matching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        # speculative decoding: each decoding sequence reserves slots for up to k draft tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.spec_min_acceptance = spec_min_acceptance  # the cut-off (DraftGate)
        self.spec_token_cost = spec_token_cost  # a draft token's cost: the draft length (DraftGate)
        # acceptance rate over every sequence's verifications: a new sequence starts with a one-draft
        # probe while it is below the break-even
        self.spec_acceptance_ema: float | None = None
        #: the back-off a new sequence starts from while acceptance is low: the last failed verification's
        #: (capped at DraftGate.max_inherited_backoff), back to the first once any verification pays
        self.spec_backoff = DraftGate.initial_backoff(spec_token_cost)
        self.max_model_len = max_model_len
        self.num_steps = 0

    # --- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._gate(seq)
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child joins the running set directly (its blocks are shared with its parent)."""
        seq.status = SeqStatus.RUNNING
        self._gate(seq)
        bisect.insort(self.running, seq, key=Sequence.arrival_key)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and free its blocks (finish or abort)."""
        if seq.status is SeqStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq.seq_id)

    def _gate(self, seq: Sequence) -> None:
        if self.num_speculative_tokens and seq.draft_gate is None:
            ema = 1.0 if self.spec_acceptance_ema is None else self.spec_acceptance_ema
            low = ema < self.spec_min_acceptance
            seq.draft_gate = DraftGate(self.spec_min_acceptance, probing=low,
                                       backoff=self.spec_backoff if low else None,
                                       token_cost=self.spec_token_cost)

    def _num_drafts(self, seq: Sequence, budget: int) -> int:
        """Draft tokens a decoding sequence may verify this step: its gate's draft length (at most k; 1 for
        a probe), fewer when the ``budget`` left for drafts, its max_tokens or max_model_len leave less room
        (every accepted draft plus the bonus token must fit). None for prefills — chunked, or a recompute after preemption, even
        a last chunk of one token before the first sample — for structured output (a grammar row decodes
        without drafts: its mask is defined for one position at a time) and for seeded random sampling
        (whether a step drafts depends on the rest of the batch, and verification draws from the seeded
        generator differently than plain sampling: a seed must give the same tokens whatever is batched)."""
        p = seq.request.params
        if (seq.num_uncomputed != 1 or not seq.num_output_tokens or not seq.request.forked
                or seq.grammar is not None or (p.seed is not None and not p.greedy)
                or not seq.draft_gate.open(self.num_steps)):
            return 0
        room = min(seq.request.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids)) - 1
        return max(0, min(seq.draft_gate.num_drafts(self.num_speculative_tokens), budget, room))

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Last pass over the sequences scheduled this step: draft slots from the token budget and free
        blocks left after every running sequence got its own tokens and waiting ones were admitted (drafts
        never push another sequence out of the step or the pool, nor delay a prefill). Returns the budget
        left."""
        for s in out.scheduled:
            if budget <= 0:
                break
            seq = s.seq
            drafts = self._num_drafts(seq, budget)
            if not drafts:
                continue
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, s.num_new + drafts)
            if copies is None:  # no free blocks left for them: decode plainly
                continue
            s.num_new += drafts
            s.max_drafts = drafts
            out.copies.extend(copies)
            budget -= drafts
        return budget

    def rollback(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After verification: the accepted drafts' KV counts as computed; blocks holding only rejected
        draft slots go back to the pool at once (the partly rejected last block is overwritten later)."""
        gate = seq.draft_gate
        gate.update(self.num_steps, num_drafts, num_accepted)
        # a closed gate (probing next) failed; an open one paid
        self.spec_backoff = (min(gate.backoff, DraftGate.max_inherited_backoff(gate.token_cost)) if gate.probing
                             else gate.first_backoff)
        rate, ema = num_accepted / num_drafts, self.spec_acceptance_ema
        self.spec_acceptance_ema = rate if ema is None else 0.7 * ema + 0.3 * rate
        seq.num_computed_tokens += num_accepted
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        self.kv.truncate(seq.seq_id, self.kv.blocks_for(seq.num_computed_tokens))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0
        seq.num_published_blocks = 0
        seq.status = SeqStatus.WAITING
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(seq)

    # --- prefix cache --------------------------------------------------------------------------
    def _lookup_prefix(self, seq: Sequence):
        """Attach the longest chain of cached full blocks, then (partial-block matching) a copy of the
        cached block sharing the most leading tokens with the next block.

        Returns (tokens reused, (src, dst) copy or None, pinned source block or None).
        """
        bs = self.block_size
        tokens = seq.token_ids
        num_full = len(tokens) // bs
        hits = []
        for h in seq.full_block_hashes(bs, num_full):
            block = self.kv.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if hits:
            self.kv.attach_cached_blocks(seq.seq_id, hits)
        cached = len(hits) * bs
        copy = pinned = None
        if self.partial_block_matching and cached < len(tokens) - 1:
            parent = seq.block_hashes[len(hits) - 1] if hits else None
            src, n = self.kv.pool.best_partial_match((parent, seq.request.hash_extra), tokens[cached : cached + bs])
            n = min(n, len(tokens) - 1 - cached)
            if src is not None and n > 0 and self.kv.pool.num_free_blocks > 1:
                self.kv.pool.incref(src)  # pinned: cannot be evicted before the copy runs
                dst = self.kv.pool.allocate()
                self.kv.block_tables.setdefault(seq.seq_id, []).append(dst)
                copy, pinned = (src.block_id, dst.block_id), src
                cached += n
        # The last token is always computed so that there are logits to sample from; writing it into
        # a published block triggers copy-on-write (kv_cache.allocate_slots).
        return min(cached, len(tokens) - 1), copy, pinned

    def publish_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's full blocks whose K/V are now computed (called after a step)."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full > seq.num_published_blocks:
            hashes = seq.full_block_hashes(self.block_size, full)
            self.kv.publish_full_blocks(seq.seq_id, hashes, seq.num_published_blocks, seq.token_ids,
                                        seq.request.hash_extra)
            seq.num_published_blocks = full

    # --- the policy ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=Sequence.arrival_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed, budget)
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            while copies is None:
                victim = self.running[-1]  # most recent arrival, not scheduled yet (index >= i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is None:
                break
            out.scheduled.append(ScheduledSeq(seq, num_new))
            out.copies.extend(copies)
            budget -= num_new
            i += 1

        if out.preempted:
            return out
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            req = seq.request
            seats = 1 if req.forked else req.params.n
            if len(self.running) + seats > self.max_num_seqs:
                break
            cached, pcopy, pinned = 0, None, None
            # prompt_logprobs need logits at every prompt position: such requests skip the cache lookup
            if (self.enable_prefix_caching and req.params.prompt_logprobs is None
                    and seq.num_computed_tokens == 0 and seq.seq_id not in self.kv.block_tables):
                cached, pcopy, pinned = self._lookup_prefix(seq)
            seq.num_computed_tokens = cached
            num_new = min(seq.num_uncomputed, budget)
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is None:  # give the prefix hits back; retry next step
                if pinned is not None:
                    self.kv.pool.decref(pinned)
                self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            if self.enable_prefix_caching and req.params.prompt_logprobs is None and not seq.num_output_tokens:
                out.prefix_cache_queries += len(seq.token_ids)
                out.prefix_cache_hits += cached
            if pcopy is not None:
                out.copies.append(pcopy)
                out.pinned.append(pinned)
            self.waiting.popleft()
            if seq.request.metrics.first_scheduled_time is None:
                req.num_cached_tokens = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            out.copies.extend(copies)
            budget -= num_new
        if self.num_speculative_tokens and (self.disable_by_batch_size is None
                                            or len(self.running) <= self.disable_by_batch_size):
            self._schedule_drafts(out, budget)
        return out
