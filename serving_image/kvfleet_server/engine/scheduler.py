"""Continuous-batching scheduler with chunked prefill, recompute preemption and prefix-cache lookup.

Every step (after vLLM v1's unified scheduler) each sequence simply has tokens whose KV is not in
the cache yet: ``len(token_ids) - num_computed_tokens`` — the whole prompt for a new request, one
token for a decode, prompt + generated tokens after a preemption. The scheduler hands out a token
budget (``max_num_batched_tokens``) per step:

1. running sequences first, oldest arrival first (decodes take 1 token, unfinished prefills a chunk);
   when the pool cannot supply a block, the most recently arrived running sequence is preempted
   (blocks freed, requeued at the front of the waiting queue, recomputed later);
2. then waiting sequences in order, as long as budget, ``max_num_seqs`` and free blocks allow
   (a waiting sequence never preempts a running one); a sequence whose LoRA adapter can get no slot
   (``LoRAManager.acquire``: every ``--max-loras`` slot is held by other adapters' running sequences)
   is skipped, keeping its place, and the ones behind it may go first (vLLM's rule). So is, with prefix
   caching, a sequence whose first uncached full block is being computed right now by a running
   sequence (the same chained block hash, not yet published) and shares at least ``INFLIGHT_MIN_TOKENS``
   more of it: it waits for those blocks to land in the cache instead of computing the same prefix
   again — SGLang's in-batch prefix caching (its threshold is 32 tokens too). Four requests arriving
   together with one long system prompt compute it once, not four times; a short common header (a chat
   template's first block) is not worth a step's wait. A waiting sequence keeps its seat: the ones
   behind it are admitted only within ``max_num_seqs`` minus the waiters' seats (``_inflight_hashes``,
   ``_waits_for_inflight``).

A sequence samples a token in a step when that step computes its last known token. Speculative decoding
reserves draft slots afterwards from what is left of the budget (``SpecDecoder.reserve``).
"""

from __future__ import annotations

import bisect
from collections import deque

from .kv_cache import KVCacheManager
from .lora import LoRAManager
from ..sequence import ScheduledSeq, SchedulerOutput, Sequence, SeqStatus


class Scheduler:
    """Decides, each step, which sequences compute how many tokens (see module docstring)."""

    #: a waiting sequence waits for a running one's blocks only when they would save it this many tokens
    INFLIGHT_MIN_TOKENS = 32

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool, partial_block_matching: bool = True, lora: LoRAManager | None = None):
        self.kv = kv
        self.lora = lora or LoRAManager()
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.partial_block_matching = partial_block_matching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions_total = 0
        self.num_steps = 0

    # --- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child joins the running set directly (its blocks are shared with its parent)."""
        seq.status = SeqStatus.RUNNING
        self.lora.acquire(seq)  # its parent holds the adapter's slot: never refused
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
        self.lora.release(seq)
        self.kv.free(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        self.lora.release(seq)
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

    def _unpublished_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of ``seq``'s full blocks (of the tokens it knows) not published yet: the blocks it is
        computing, or will compute, itself."""
        full = len(seq.token_ids) // self.block_size
        return seq.full_block_hashes(self.block_size, full)[seq.num_published_blocks:] if full else []

    def _inflight_hashes(self) -> set[bytes]:
        return {h for seq in self.running for h in self._unpublished_hashes(seq)}

    def _waits_for_inflight(self, seq: Sequence, inflight: set[bytes]) -> bool:
        """Whether ``seq``'s first full blocks missing from the cache — at least ``INFLIGHT_MIN_TOKENS``
        of them — are ones a running sequence is computing (same chained hash: the same tokens, adapter
        and salt from the start)."""
        if not inflight:
            return False
        shared = 0
        for h in seq.full_block_hashes(self.block_size, len(seq.token_ids) // self.block_size):
            if shared == 0 and self.kv.pool.lookup(h) is not None:
                continue  # cached already
            if h not in inflight:
                break
            shared += self.block_size
            if shared >= self.INFLIGHT_MIN_TOKENS:
                return True
        return False

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
        skipped: list[Sequence] = []
        held = 0  # seats of the sequences waiting for in-flight blocks: kept for them
        inflight: set[bytes] | None = None  # built on first need, extended by each sequence scheduled below
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            req = seq.request
            seats = 1 if req.forked else req.params.n
            if len(self.running) + held + seats > self.max_num_seqs:
                break
            # prompt_logprobs need logits at every prompt position: such requests skip the cache lookup
            lookup = (self.enable_prefix_caching and req.params.prompt_logprobs is None
                      and seq.num_computed_tokens == 0 and seq.seq_id not in self.kv.block_tables)
            if lookup:
                inflight = self._inflight_hashes() if inflight is None else inflight
                if self._waits_for_inflight(seq, inflight):  # its prefix lands in the cache soon: wait for it
                    held += seats
                    skipped.append(self.waiting.popleft())
                    continue
            if not self.lora.acquire(seq):  # its adapter can get no slot now: keep its place, try the next
                skipped.append(self.waiting.popleft())
                continue
            cached, pcopy, pinned = 0, None, None
            if lookup:
                cached, pcopy, pinned = self._lookup_prefix(seq)
            seq.num_computed_tokens = cached
            num_new = min(seq.num_uncomputed, budget)
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is None:  # give the prefix hits and the adapter slot back; retry next step
                if pinned is not None:
                    self.kv.pool.decref(pinned)
                self.kv.free(seq.seq_id)
                self.lora.release(seq)
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
            if inflight is not None:
                inflight.update(self._unpublished_hashes(seq))
            out.scheduled.append(ScheduledSeq(seq, num_new))
            out.copies.extend(copies)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out
