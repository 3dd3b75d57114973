"""Counters and gauges the engine publishes after each step; the server turns them into vLLM's metrics.

The engine owns the numbers, the server owns Prometheus: ``LLMEngine.get_stats()`` returns a fresh
``SchedulerStats`` snapshot, and ``LLMEngine.step()`` fills ``LLMEngine.last_iteration`` with the
``IterationStats`` of that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """Gauges at one instant.

    Attributes:
        num_running: sequences groups scheduled (in the running queue).
        num_waiting: requests waiting for admission (including preempted ones).
        kv_cache_usage: fraction of KV blocks in use by live requests, 0..1 (cached-but-free blocks
            count as free, as in vLLM).
        num_blocks_total / num_blocks_free / num_blocks_cached: KV block pool counts; cached blocks
            are free blocks that still hold a reusable prefix.
        running_lora_adapters / waiting_lora_adapters: names of the adapters of the running and the waiting
            requests (each once); max_lora: --max-loras (0 without --enable-lora).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    num_blocks_cached: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0


@dataclass
class IterationStats:
    """What one engine step did (all counts in tokens unless named otherwise).

    Attributes:
        num_prompt_tokens: prompt tokens computed by prefill in this step (cache hits excluded).
        num_generation_tokens: tokens sampled in this step.
        num_preemptions: sequences preempted in this step.
        prefix_cache_queries: prompt tokens looked up in the prefix cache at admission.
        prefix_cache_hits: of those, tokens whose KV was reused.
        num_jump_forward_tokens: tokens appended from grammars' forced continuations (no sampling).
        structured_output_mask_s: seconds spent filling grammar bitmasks in this step.
        num_drafts: sequences that verified draft tokens (speculative decoding).
        num_draft_tokens: draft tokens verified; num_accepted_tokens: of those, accepted.
        num_accepted_tokens_per_pos: [k] accepted drafts at each draft position 0..k-1.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_jump_forward_tokens: int = 0
    structured_output_mask_s: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generation_tokens
