"""SpecDecoder: speculative decoding's one engine-facing object (reserve → propose → verify → rollback,
gated per sequence).

- **reserve**: the scheduler reserves KV slots for up to γ drafts per decoding sequence, γ ≤ k chosen by
  the sequence's ``DraftGate`` (gate.py) from ``scheduler_settings``;
- **propose** (``before_forward``): the proposer fills the reserved slots; slots it leaves empty go back to
  the pool before the forward pass;
- **verify** (``verify``): the target's rows of each drafted sequence are rejection-sampled
  (sample/rejection.py; Leviathan et al. 2023, Chen et al. 2023), the rejected tail is rolled back in the
  scheduler and KV cache, and the accepted tokens plus one (corrected or bonus) token go to the output
  processor.

The engine holds one only when a drafter runs (``SpecDecoder.create``), so a step without speculation
never enters this module.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..sample.rejection import VerifySpan, verify
from ..sequence import ScheduledSeq, Sequence
from ..spec_decode_config import SpeculativeConfig
from ..stats import IterationStats
from . import build_proposer, draft_cost
from .gate import DraftGate
from .proposer import DraftRequest, Drafts, Proposer, break_even_acceptance

logger = logging.getLogger("kvfleet.engine")


def scheduler_settings(cfg: SpeculativeConfig, cost: float, device: str) -> dict:
    """The scheduler's speculation settings (``Scheduler`` keyword arguments) from a draft token's ``cost``
    relative to a decode step on ``device`` (``draft_cost``; ``DraftGate``); logs them. A method no
    acceptance rate can pay for here (break-even ≥ 1) gets num_speculative_tokens 0: no drafter is built
    (no draft model loaded, no memory in the KV pool, no work per step)."""
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
    return dict(num_speculative_tokens=k, disable_by_batch_size=cfg.disable_by_batch_size,
                spec_min_acceptance=cut, spec_token_cost=token_cost)


class SpecDecoder:
    """Proposes drafts before the target's forward pass and verifies them after it.

    Attributes:
        config: the SpeculativeConfig.
        proposer: the drafter (ngram, draft model or layer skip; ``Proposer``).
        extra_kv_bytes_per_token: KV bytes the drafter keeps per token in the shared block pool.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config = config
        self.proposer = proposer
        self.extra_kv_bytes_per_token = proposer.extra_kv_bytes_per_token

    @staticmethod
    def create(config: SpeculativeConfig, model, model_config, dtype, device: str,
               max_model_len: int) -> tuple[SpecDecoder | None, dict]:
        """(decoder, scheduler settings): the decoder is None when no acceptance rate pays for the method on
        ``device`` (nothing is loaded). Raises ValueError naming the speculative_config key when the draft
        does not fit the target; ModelLoadError when the draft model cannot be read."""
        settings = scheduler_settings(config, draft_cost(config, model, model_config, dtype, max_model_len), device)
        if not settings["num_speculative_tokens"]:  # a draft that cannot pay here is never loaded
            return None, settings
        return SpecDecoder(config, build_proposer(config, dtype, device, max_model_len)), settings

    def bind(self, runner) -> None:
        """Give the drafter the target's runner (its KV pool, for draft-model and layer-skip KV)."""
        self.proposer.bind(runner)

    def before_forward(self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]], kv,
                       runner) -> tuple[dict[int, Drafts], list[tuple[int, int]]]:
        """Propose drafts where the scheduler reserved slots (``ScheduledSeq.draft_ids`` and ``num_new``
        updated; unused slots truncated from ``kv``). The step's copy-on-write ``copies`` (block id pairs)
        run first on every rank and in the drafter's KV, since the drafters read KV before the step.
        Returns ({index in scheduled: Drafts} for the sequences with drafts, the copies still to run)."""
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

    def verify(self, scheduled: list[ScheduledSeq], batch, drafts: dict[int, Drafts], runner, scheduler,
               sample_row: Callable, append: Callable, it: IterationStats) -> list[Sequence]:
        """Rejection-sample each drafted sequence's rows, roll the rejected tail back (``scheduler.rollback``),
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
            scheduler.rollback(seq, k, r.num_accepted)
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
