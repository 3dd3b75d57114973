"""What the engine returns for a request: ``RequestOutput`` holding one ``CompletionOutput`` per sample.

The step-level engine emits a RequestOutput for every request that produced tokens in a step
(``text``/``token_ids`` are cumulative; ``delta_text``/``delta_token_ids`` are what is new since
the previous output, with any possible stop-string prefix held back until it is resolved).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token (natural log), with its decoded text and rank (1 = most likely)."""

    token_id: int
    logprob: float
    decoded: str
    rank: int | None = None


# Per position: the chosen token's Logprob plus up to k top alternatives, keyed by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sampled completion.

    Attributes:
        index: which of the request's n samples this is.
        text / token_ids: everything generated so far (stop string excluded).
        delta_text / delta_token_ids: new since the previous RequestOutput of this request.
        logprobs: per generated token, when SamplingParams.logprobs is set.
        finish_reason: None while running; "stop" | "length" | "abort" when finished.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    delta_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request's life (time.monotonic() seconds) for the serving metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """Output of one request after an engine step.

    Attributes:
        request_id: the id given to add_request.
        prompt: the prompt text (None when given as token ids and not decoded).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt position (first is None), when requested.
        outputs: one CompletionOutput per sample (n of them).
        finished: all samples are finished.
        metrics: timestamps for TTFT / queue / prefill / decode histograms.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
