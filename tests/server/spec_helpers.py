"""Helpers of the speculative decoding tests (imported as a plain module: tests/server is on sys.path)."""

from __future__ import annotations

from engine_helpers import assert_pool_consistent


class SpecStepChecker:
    """``on_step`` callback: checks the pool's reference counts after every step and sums the step's
    speculative counters (IterationStats) and preemptions, asserting each step's own consistency."""

    def __init__(self):
        self.drafts = self.draft_tokens = self.accepted = self.preemptions = 0
        self.prompt_tokens_with_decodes = 0
        self.per_pos: list[int] = []
        self.steps = 0

    def __call__(self, engine) -> None:
        assert_pool_consistent(engine)
        it = engine.last_iteration
        self.steps += 1
        assert 0 <= it.num_accepted_tokens <= it.num_draft_tokens
        assert sum(it.num_accepted_tokens_per_pos) == it.num_accepted_tokens
        assert all(a >= b for a, b in zip(it.num_accepted_tokens_per_pos, it.num_accepted_tokens_per_pos[1:]))
        assert len(it.num_accepted_tokens_per_pos) <= it.num_draft_tokens
        self.drafts += it.num_drafts
        self.draft_tokens += it.num_draft_tokens
        self.accepted += it.num_accepted_tokens
        self.preemptions += it.num_preemptions
        self.prompt_tokens_with_decodes += bool(it.num_prompt_tokens and it.num_generation_tokens)
        self.per_pos += [0] * (len(it.num_accepted_tokens_per_pos) - len(self.per_pos))
        for j, n in enumerate(it.num_accepted_tokens_per_pos):
            self.per_pos[j] += n
