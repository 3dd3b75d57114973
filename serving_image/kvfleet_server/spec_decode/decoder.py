"""SpecDecoder: speculative decoding's one engine-facing object (reserve → propose → verify → rollback,
gated per sequence).

- **reserve** (``before_forward``, after the scheduler has placed every sequence's own tokens): KV slots
  for up to γ drafts per decoding sequence from the token budget and free blocks left, γ ≤ k chosen by
  the sequence's ``DraftGate`` (gate.py) under the settings of ``gate_settings``;
- **propose** (``before_forward``): the proposer fills the reserved slots; slots it leaves empty go back to
  the pool before the forward pass;
- **verify** (``verify``): the target's rows of each drafted sequence are rejection-sampled
  (sample/rejection.py; Leviathan et al. 2023, Chen et al. 2023), the rejected tail is rolled back
  (``rollback``: the gate learns from the verification, rejected slots go back to the KV pool), and the
  accepted tokens plus one (corrected or bonus) token go to the output processor.

The engine holds one only when a drafter runs (``SpecDecoder.create``), so a step without speculation
never enters this module.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..sample.rejection import VerifySpan, verify
from ..sequence import ScheduledSeq, SchedulerOutput, Sequence
from ..spec_decode_config import SpeculativeConfig
from ..stats import IterationStats
from . import build_proposer, draft_cost
from .gate import DraftGate
from .proposer import DraftRequest, Drafts, Proposer, break_even_acceptance

logger = logging.getLogger("kvfleet.engine")


def gate_settings(cfg: SpeculativeConfig, cost: float, device: str) -> dict:
    """The draft gates' settings (``SpecDecoder`` keyword arguments) from a draft token's ``cost`` relative
    to a decode step on ``device`` (``draft_cost``; ``DraftGate``); logs them. A method no acceptance rate
    can pay for here (break-even ≥ 1) gets num_speculative_tokens 0: no drafter is built (no draft model
    loaded, no memory in the KV pool, no work per step)."""
    be = break_even_acceptance(cost, device)
    cut = DraftGate.cut_off(be) if cfg.min_acceptance is None else cfg.min_acceptance
    # the draft length weighs each token at the break-even cost (an explicit cut-off below it
    # lowers it: min_acceptance 0 always verifies k drafts)
    token_cost = be if cfg.min_acceptance is None else min(be, cfg.min_acceptance)
    k = cfg.num_speculative_tokens if cut < 1 else 0
    logger.log(logging.INFO if k else logging.WARNING,
               "speculative decoding: %s, up to %d tokens; a draft costs %.2f of a decode step, break-even "
               "acceptance %.2f, cut-off %.2f%s", cfg.method, cfg.num_speculative_tokens, cost, be, cut,
               "" if k else " — no acceptance rate pays on this device: speculation is off, no draft loaded")
    return dict(num_speculative_tokens=k, min_acceptance=cut, token_cost=token_cost)


class SpecDecoder:
    """Reserves draft slots and proposes drafts before the target's forward pass, verifies them after it.

    Attributes:
        config: the SpeculativeConfig.
        proposer: the drafter (ngram, draft model or layer skip; ``Proposer``).
        extra_kv_bytes_per_token: KV bytes the drafter keeps per token in the shared block pool.
        num_speculative_tokens: k, the most drafts a sequence verifies in a step.
        min_acceptance / token_cost: the gates' cut-off and a draft token's cost (``DraftGate``).
        acceptance_ema: acceptance rate over every sequence's verifications (None before the first): a new
            sequence starts with a one-draft probe while it is below the cut-off.
        backoff: the back-off a new sequence starts from while acceptance is low: the last failed
            verification's (capped at ``DraftGate.max_inherited_backoff``), back to the first once any
            verification pays.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, num_speculative_tokens: int,
                 min_acceptance: float = DraftGate.MIN_ACCEPTANCE, token_cost: float = 0.0):
        self.config = config
        self.proposer = proposer
        self.extra_kv_bytes_per_token = proposer.extra_kv_bytes_per_token
        self.num_speculative_tokens = num_speculative_tokens
        self.min_acceptance = min_acceptance
        self.token_cost = token_cost
        self.acceptance_ema: float | None = None
        self.backoff = DraftGate.initial_backoff(token_cost)

    @staticmethod
    def create(config: SpeculativeConfig, model, model_config, dtype, device: str,
               max_model_len: int) -> SpecDecoder | None:
        """The decoder, or None when no acceptance rate pays for the method on ``device`` (nothing is
        loaded). Raises ValueError naming the speculative_config key when the draft does not fit the target;
        ModelLoadError when the draft model cannot be read."""
        settings = gate_settings(config, draft_cost(config, model, model_config, dtype, max_model_len), device)
        if not settings["num_speculative_tokens"]:  # a draft that cannot pay here is never loaded
            return None
        return SpecDecoder(config, build_proposer(config, dtype, device, max_model_len), **settings)

    def bind(self, runner) -> None:
        """Give the drafter the target's runner (its KV pool, for draft-model and layer-skip KV)."""
        self.proposer.bind(runner)

    # --- reserve ---------------------------------------------------------------------------------
    def _gate(self, seq: Sequence) -> DraftGate:
        """The sequence's gate, made at its first decode: a probe with the inherited back-off while the
        acceptance over all sequences is below the cut-off."""
        if seq.draft_gate is None:
            ema = 1.0 if self.acceptance_ema is None else self.acceptance_ema
            low = ema < self.min_acceptance
            seq.draft_gate = DraftGate(self.min_acceptance, probing=low, backoff=self.backoff if low else None,
                                       token_cost=self.token_cost)
        return seq.draft_gate

    def num_drafts(self, seq: Sequence, budget: int, step: int) -> int:
        """Draft tokens a decoding sequence may verify at scheduler step ``step``: its gate's draft length
        (at most k; 1 for a probe), fewer when the ``budget`` left for drafts or its remaining output
        (``Sequence.num_tokens_left``: every accepted draft plus the bonus token must fit) leave less room.
        0 for prefills — chunked, or a recompute after preemption, even a last chunk of one token before the
        first sample — for structured output (a grammar row decodes without drafts: its mask is defined for
        one position at a time) and for seeded random sampling (whether a step drafts depends on the rest
        of the batch, and verification draws from the seeded generator differently than plain sampling: a
        seed must give the same tokens whatever is batched)."""
        p = seq.request.params
        if (seq.num_uncomputed != 1 or not seq.num_output_tokens or not seq.request.forked
                or seq.grammar is not None or (p.seed is not None and not p.greedy)
                or not self._gate(seq).open(step)):
            return 0
        return max(0, min(seq.draft_gate.num_drafts(self.num_speculative_tokens), budget, seq.num_tokens_left - 1))

    def reserve(self, sched: SchedulerOutput, budget: int, num_running: int, step: int, kv) -> None:
        """Draft slots for the sequences scheduled this step, from the token ``budget`` and free blocks left
        after every running sequence got its own tokens and waiting ones were admitted (drafts never push
        another sequence out of the step or the pool, nor delay a prefill): ``ScheduledSeq.max_drafts`` and
        ``num_new`` grow, their copy-on-write copies join ``sched.copies``. Nothing in a step that preempted,
        or with more than ``disable_by_batch_size`` running sequences."""
        limit = self.config.disable_by_batch_size
        if sched.preempted or (limit is not None and num_running > limit):
            return
        for s in sched.scheduled:
            if budget <= 0:
                break
            seq = s.seq
            drafts = self.num_drafts(seq, budget, step)
            if not drafts:
                continue
            copies = kv.allocate_slots(seq.seq_id, seq.num_computed_tokens, s.num_new + drafts)
            if copies is None:  # no free blocks left for them: decode plainly
                continue
            s.num_new += drafts
            s.max_drafts = drafts
            sched.copies.extend(copies)
            budget -= drafts

    # --- propose -----------------------------------------------------------------------------------
    def before_forward(self, sched: SchedulerOutput, scheduler, kv, runner
                       ) -> tuple[dict[int, Drafts], list[tuple[int, int]]]:
        """Reserve draft slots (``reserve``, from what ``scheduler`` left of its budget), then propose drafts
        where slots were reserved (``ScheduledSeq.draft_ids`` and ``num_new`` updated; unused slots truncated
        from ``kv``). The step's copy-on-write copies (block id pairs) run first on every rank and in the
        drafter's KV, since the drafters read KV before the step. Returns ({index in ``sched.scheduled``:
        Drafts} for the sequences with drafts, the copies still to run)."""
        scheduled = sched.scheduled
        self.reserve(sched, scheduler.max_num_batched_tokens - sched.num_tokens, len(scheduler.running),
                     scheduler.num_steps, kv)
        copies = sched.copies
        if copies:
            runner.copy_blocks_on_every_rank(copies)
            self.proposer.copy_blocks(copies)
            copies = []
        idx = [i for i, s in enumerate(scheduled) if s.max_drafts]
        if not idx:
            return {}, copies
        reqs = [DraftRequest(scheduled[i].seq, scheduled[i].max_drafts, kv.block_ids(scheduled[i].seq.seq_id))
                for i in idx]
        out = {}
        for i, d in zip(idx, self.proposer.propose(reqs)):
            s = scheduled[i]
            s.draft_ids = list(d.token_ids)
            s.num_new = s.num_new - s.max_drafts + len(s.draft_ids)
            if len(s.draft_ids) < s.max_drafts:
                kv.truncate(s.seq.seq_id, kv.blocks_for(s.seq.num_computed_tokens + s.num_new))
            if s.draft_ids:
                out[i] = d
        return out, copies

    # --- verify and roll back -------------------------------------------------------------------------
    def rollback(self, seq: Sequence, num_drafts: int, num_accepted: int, step: int, kv) -> None:
        """After verification at scheduler step ``step``: the gate learns the outcome, the accepted drafts'
        KV counts as computed, and blocks holding only rejected draft slots go back to the pool at once (the
        partly rejected last block is overwritten later)."""
        gate = seq.draft_gate
        gate.update(step, num_drafts, num_accepted)
        # a closed gate (probing next) failed; an open one paid
        self.backoff = (min(gate.backoff, DraftGate.max_inherited_backoff(gate.token_cost)) if gate.probing
                        else gate.first_backoff)
        rate, ema = num_accepted / num_drafts, self.acceptance_ema
        self.acceptance_ema = rate if ema is None else 0.7 * ema + 0.3 * rate
        seq.num_computed_tokens += num_accepted
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        kv.truncate(seq.seq_id, kv.blocks_for(seq.num_computed_tokens))

    def verify(self, scheduled: list[ScheduledSeq], batch, drafts: dict[int, Drafts], runner, scheduler,
               sample_row: Callable, append: Callable, it: IterationStats) -> list[Sequence]:
        """Rejection-sample each drafted sequence's rows, roll the rejected tail back (``rollback``),
        hand the accepted tokens and the one that follows them to ``append(seq, token, logprob)`` (cut at
        the first that finishes the sequence) and publish the verified blocks. ``sample_row(seq, drafts)``
        gives a row's sampling context. Counts drafts and acceptances in ``it``; returns the sequences."""
        order = sorted(drafts)
        rows: list[int] = []
        spans: list[VerifySpan] = []
        for i in order:
            s, d = scheduled[i], drafts[i]
            start, n = batch.chunk_rows[i]
            rows.extend(range(start, start + n))
            spans.append(VerifySpan([sample_row(s.seq, s.draft_ids[:j]) for j in range(n)], s.draft_ids, d.probs))
        logits = runner.compute_logits(batch, rows)
        now = time.monotonic()
        done = []
        for i, r in zip(order, verify(logits, spans)):
            seq = scheduled[i].seq
            k = len(scheduled[i].draft_ids)
            it.num_drafts += 1
            it.num_draft_tokens += k
            it.num_accepted_tokens += r.num_accepted
            per_pos = it.num_accepted_tokens_per_pos
            per_pos.extend([0] * (k - len(per_pos)))
            for j in range(r.num_accepted):
                per_pos[j] += 1
            self.rollback(seq, k, r.num_accepted, scheduler.num_steps, scheduler.kv)
            for tok, lp in zip(r.token_ids, r.logprobs):
                append(seq, tok, lp)
                it.num_generation_tokens += 1
                if seq.is_finished:
                    break
            if not seq.is_finished:
                scheduler.publish_computed_blocks(seq)
            m = seq.request.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            done.append(seq)
        return done
