"""Helpers of the speculative decoding tests (imported as a plain module: tests/server is on sys.path)."""

from __future__ import annotations

from kvfleet_server import SamplingParams

from engine_helpers import assert_pool_consistent, run_to_completion


def greedy_with_step_counts(engine, prompt_token_ids: list[int], max_tokens: int,
                            counter: str = "num_draft_tokens") -> tuple[list[int], list[int]]:
    """Run one greedy request (``ignore_eos``) alone on ``engine`` to completion: (its output token ids,
    ``engine.last_iteration.<counter>`` at every step)."""
    engine.add_request("x", prompt_token_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    counts: list[int] = []
    finals = run_to_completion(engine, on_step=lambda e: counts.append(getattr(e.last_iteration, counter)))
    return finals["x"].outputs[0].token_ids, counts


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
