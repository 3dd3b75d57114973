"""The per-sequence draft gate of speculative decoding: when to speculate, and how many drafts (γ ≤ k)."""

from __future__ import annotations

import math


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
