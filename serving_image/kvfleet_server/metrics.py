"""Prometheus metrics with vLLM 0.32's names, types and labels (``model_name``, ``engine``).

Existing vLLM dashboards, alerts, KEDA/HPA rules and the kvfleet operator read these unchanged.
Each server owns its own ``CollectorRegistry`` (several apps can live in one test process).
The engine thread feeds it: ``on_step`` after every engine step with that step's ``IterationStats``,
the fresh ``SchedulerStats`` and the step's ``RequestOutput``s; ``on_abort`` when a request is
aborted before finishing. All times are seconds (``time.monotonic``); token counts are tokens.

Prompt tokens have vLLM v1's meaning (vllm/v1/metrics/stats.py and loggers.py): ``vllm:prompt_tokens_total``
counts each request's whole prompt once, when its first token is sampled, prefix-cache hits included;
``vllm:prompt_tokens_cached_total`` counts the cached part of those prompts, and the histogram
``vllm:request_prefill_kv_computed_tokens`` observes, per finished request, prompt tokens minus cached ones
(the KV actually computed). The stats log line's "prompt throughput" is computed tokens, as vLLM's.

It also keeps the counters of the periodic stats log line (vLLM's "Avg prompt throughput ... Prefix cache
hit rate" line): ``maybe_log`` is called by the engine thread after each step and when idle, costs one
clock comparison, and logs at most once per ``log_stats_interval_s`` while there has been activity.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .stats import IterationStats, SchedulerStats

# Bucket edges as vLLM uses them (seconds).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
STRUCTURED_REJECTIONS = ("invalid", "unsupported_feature", "compile_timeout")
COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
LOG_STATS_INTERVAL_S = 10.0  # vLLM's default interval of its stats log line

stats_logger = logging.getLogger("kvfleet.stats")


def format_stats_log(*, interval_s: float, prompt_tokens: int, generation_tokens: int, num_running: int,
                     num_waiting: int, kv_cache_usage: float, cache_queries: int, cache_hits: int,
                     total_cache_queries: int, total_cache_hits: int, engine: str = "0") -> str:
    """The periodic stats line, in vLLM's wording.

    Args:
        interval_s: seconds since the previous line (> 0).
        prompt_tokens / generation_tokens: tokens prefilled (prefix-cache hits excluded) / sampled in the interval.
        num_running / num_waiting: request counts now.
        kv_cache_usage: fraction of KV blocks held by live requests now, 0..1 (printed as a percentage).
        cache_queries / cache_hits: prompt tokens looked up in / found in the prefix cache in the interval.
        total_cache_queries / total_cache_hits: the same since the server started.

    The prefix cache hit rate is hits / queries in tokens, over the interval and since start; 0.0% when
    nothing was looked up (e.g. --no-enable-prefix-caching).
    """
    def pct(num, den):
        return 100.0 * num / den if den else 0.0

    eng = f"{int(engine):03d}" if str(engine).isdigit() else str(engine)
    return (f"Engine {eng}: Avg prompt throughput: {prompt_tokens / interval_s:.1f} tokens/s, "
            f"Avg generation throughput: {generation_tokens / interval_s:.1f} tokens/s, "
            f"Running: {num_running} reqs, Waiting: {num_waiting} reqs, "
            f"KV cache usage: {100.0 * kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {pct(cache_hits, cache_queries):.1f}% "
            f"(since start {pct(total_cache_hits, total_cache_queries):.1f}%)")


def format_spec_decode_log(*, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                           accepted_per_pos: list[int], interval_s: float, engine: str = "0") -> str:
    """vLLM's "SpecDecoding metrics" line over one interval: mean acceptance length = 1 + accepted /
    drafts (tokens emitted per verification, bonus included), per-position acceptance rate = accepted
    at position j / drafts, draft acceptance rate = accepted / drafted tokens."""
    eng = f"{int(engine):03d}" if str(engine).isdigit() else str(engine)
    mean_len = 1.0 + num_accepted_tokens / num_drafts if num_drafts else 0.0
    rates = ", ".join(f"{a / num_drafts:.3f}" if num_drafts else "0.000" for a in accepted_per_pos)
    rate = 100.0 * num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0
    return (f"Engine {eng}: SpecDecoding metrics: Mean acceptance length: {mean_len:.2f}, "
            f"Accepted throughput: {num_accepted_tokens / interval_s:.2f} tokens/s, "
            f"Drafted throughput: {num_draft_tokens / interval_s:.2f} tokens/s, "
            f"Accepted: {num_accepted_tokens} tokens, Drafted: {num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, Avg Draft acceptance rate: {rate:.1f}%")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class ServerMetrics:
    """vLLM-named metrics of one served model.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        max_model_len: upper end of the token-count histograms.
        max_num_batched_tokens: upper end of ``vllm:iteration_tokens_total``.
        engine: value of the ``engine`` label (engine index, "0" for a single engine).
        registry: registry to register in; a fresh one by default.
        log_stats_interval_s: seconds between two stats log lines (``maybe_log``); None: never log.
    """

    def __init__(self, model_name: str, max_model_len: int = 2048, max_num_batched_tokens: int = 2048,
                 engine: str = "0", registry: CollectorRegistry | None = None,
                 log_stats_interval_s: float | None = LOG_STATS_INTERVAL_S):
        self.registry = registry or CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": engine}
        names = list(self.labels)
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, names, registry=r).labels(**self.labels)

        def counter(name, doc):
            return Counter(name, doc, names, registry=r).labels(**self.labels)

        def hist(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.num_requests_running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc",
                                     "KV-cache usage (older name of vllm:kv_cache_usage_perc). 1 means 100 percent.")
        self.blocks_total = gauge("kvfleet:kv_cache_blocks_total", "KV-cache blocks in the pool.")
        self.blocks_free = gauge("kvfleet:kv_cache_blocks_free", "KV-cache blocks not held by a live request.")
        self.blocks_cached = gauge("kvfleet:kv_cache_blocks_cached",
                                   "Free KV-cache blocks that still hold a reusable prefix (prefix cache size).")

        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self._request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                        names + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._request_success.labels(**self.labels, finished_reason=reason)
        self._rejections = Counter("vllm:admission_rejections", "Requests refused at admission.",
                                   names + ["reason"], registry=r)
        for reason in ("queue_full", "draining"):
            self._rejections.labels(**self.labels, reason=reason)

        self._so_requests = Counter("kvfleet:structured_output_requests",
                                    "Requests admitted with a structured-output grammar, by kind.",
                                    names + ["kind"], registry=r)
        for kind in STRUCTURED_KINDS:
            self._so_requests.labels(**self.labels, kind=kind)
        self._so_rejections = Counter("kvfleet:structured_output_rejections",
                                      "Structured-output requests refused (HTTP 400), by reason.",
                                      names + ["reason"], registry=r)
        for reason in STRUCTURED_REJECTIONS:
            self._so_rejections.labels(**self.labels, reason=reason)
        self.so_compile_time = hist("kvfleet:structured_output_compile_seconds",
                                    "Seconds to compile a request's grammar (cache hits included).", COMPILE_BUCKETS)
        self.jump_forward_tokens = counter("kvfleet:jump_forward_tokens",
                                           "Tokens appended from grammars' forced continuations without sampling.")
        self.kv_events_dropped = counter("kvfleet:kv_events_dropped",
                                         "KV-event batches (one per engine step) dropped because the publisher's "
                                         "queue was full (--kv-events-config max_queue_size).")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.tpot_legacy = hist("vllm:time_per_output_token_seconds",
                                "Histogram of time per output token in seconds (older name).", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                          token_buckets)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Number of generation tokens processed.", token_buckets)
        self.request_prefill_kv_computed = hist("vllm:request_prefill_kv_computed_tokens",
                                                "Histogram of new KV tokens computed during prefill "
                                                "(excluding cached tokens).", token_buckets)
        iter_buckets = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
        iter_buckets = [b for b in iter_buckets if b <= max(max_num_batched_tokens, 1)]
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     iter_buckets or [1])
        self._cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   ["block_size", "num_gpu_blocks", "enable_prefix_caching",
                                    "gpu_memory_utilization", "kv_cache_dtype", "engine"], registry=r)
        self._lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._lora_labels: tuple[str, str, str] | None = None
        self._timings: dict[str, _Timing] = {}
        self.log_stats_interval_s = log_stats_interval_s
        self._log_last: float | None = None
        self._win = [0, 0, 0, 0]  # prompt, generation, cache queries, cache hits since the last log line
        self._cache_totals = [0, 0]  # cache queries, hits since start
        self.num_speculative_tokens = 0
        self._spec_win = [0, 0, 0]  # drafts, draft tokens, accepted tokens since the last log line
        self._spec_win_pos: list[int] = []

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        """Create vLLM's speculative decoding counters (only servers that speculate export them)."""
        names = list(self.labels)
        r = self.registry
        k = self.num_speculative_tokens = num_speculative_tokens
        self.spec_num_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                       names, registry=r).labels(**self.labels)
        self.spec_num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                             names, registry=r).labels(**self.labels)
        self.spec_num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens",
                                                "Number of accepted tokens.", names, registry=r).labels(**self.labels)
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Accepted tokens per draft position.", names + ["position"], registry=r)
        self.spec_accepted_per_pos = [per_pos.labels(**self.labels, position=str(j)) for j in range(k)]
        self._spec_win_pos = [0] * k

    # ------------------------------------------------------------------ producers

    def set_cache_config(self, *, block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool,
                         gpu_memory_utilization: float, kv_cache_dtype: str) -> None:
        """Publish the KV-cache configuration as the info gauge (value 1)."""
        self._cache_config.labels(block_size=str(block_size), num_gpu_blocks=str(num_gpu_blocks),
                                  enable_prefix_caching=str(bool(enable_prefix_caching)),
                                  gpu_memory_utilization=str(gpu_memory_utilization),
                                  kv_cache_dtype=str(kv_cache_dtype), engine=self.labels["engine"]).set(1)

    def set_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self.blocks_total.set(stats.num_blocks_total)
        self.blocks_free.set(stats.num_blocks_free)
        self.blocks_cached.set(stats.num_blocks_cached)
        if stats.max_lora:
            self._set_lora_info(stats)

    def _set_lora_info(self, stats: SchedulerStats) -> None:
        """vLLM's ``vllm:lora_requests_info``: one series whose labels name the adapters of the running and
        waiting requests (comma-separated) and whose value is the time it was set (seconds since the
        epoch; the Inference Extension's lora-affinity scorer reads the newest). The previous series is
        removed when the labels change."""
        labels = (str(stats.max_lora), ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters))
        if labels != self._lora_labels and self._lora_labels is not None:
            self._lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def request_added(self, request_id: str, arrival: float) -> None:
        self._timings[request_id] = _Timing(arrival=arrival)

    def admission_rejected(self, reason: str) -> None:
        self._rejections.labels(**self.labels, reason=reason).inc()

    def structured_output_compiled(self, kind: str, seconds: float) -> None:
        """A request's grammar is ready (it is admitted next)."""
        self._so_requests.labels(**self.labels, kind=kind).inc()
        self.so_compile_time.observe(seconds)

    def structured_output_rejected(self, reason: str) -> None:
        self._so_rejections.labels(**self.labels, reason=reason).inc()

    def on_iteration(self, it: IterationStats) -> None:
        """Account one engine step (prompt tokens are counted per request in ``on_output``, vLLM's meaning)."""
        self.jump_forward_tokens.inc(getattr(it, "num_jump_forward_tokens", 0))
        self.generation_tokens.inc(it.num_generation_tokens)
        self.num_preemptions.inc(it.num_preemptions)
        self.prefix_cache_queries.inc(it.prefix_cache_queries)
        self.prefix_cache_hits.inc(it.prefix_cache_hits)
        if it.num_tokens:
            self.iteration_tokens.observe(it.num_tokens)
        w = self._win
        w[0] += it.num_prompt_tokens
        w[1] += it.num_generation_tokens
        w[2] += it.prefix_cache_queries
        w[3] += it.prefix_cache_hits
        self._cache_totals[0] += it.prefix_cache_queries
        self._cache_totals[1] += it.prefix_cache_hits
        if self.num_speculative_tokens and it.num_drafts:
            self.spec_num_drafts.inc(it.num_drafts)
            self.spec_num_draft_tokens.inc(it.num_draft_tokens)
            self.spec_num_accepted_tokens.inc(it.num_accepted_tokens)
            sw = self._spec_win
            sw[0] += it.num_drafts
            sw[1] += it.num_draft_tokens
            sw[2] += it.num_accepted_tokens
            for j, n in enumerate(it.num_accepted_tokens_per_pos):
                self.spec_accepted_per_pos[j].inc(n)
                self._spec_win_pos[j] += n

    def maybe_log(self, stats: SchedulerStats, now: float | None = None) -> str | None:
        """Log (at INFO on ``kvfleet.stats``) and return the stats line when ``log_stats_interval_s`` has
        passed since the previous one and the interval saw tokens or cache lookups, or requests are running/waiting;
        else None. The first call only starts the clock. Called from the engine thread only."""
        if self.log_stats_interval_s is None:
            return None
        now = time.monotonic() if now is None else now
        if self._log_last is None:
            self._log_last = now
            return None
        elapsed = now - self._log_last
        if elapsed < self.log_stats_interval_s:
            return None
        w, self._win = self._win, [0, 0, 0, 0]
        self._log_last = now
        if not (any(w) or stats.num_running or stats.num_waiting):
            return None
        line = format_stats_log(interval_s=elapsed, prompt_tokens=w[0], generation_tokens=w[1],
                                num_running=stats.num_running, num_waiting=stats.num_waiting,
                                kv_cache_usage=stats.kv_cache_usage, cache_queries=w[2], cache_hits=w[3],
                                total_cache_queries=self._cache_totals[0], total_cache_hits=self._cache_totals[1],
                                engine=self.labels["engine"])
        stats_logger.info(line)
        if self.num_speculative_tokens:
            sw, pos = self._spec_win, self._spec_win_pos
            spec_line = format_spec_decode_log(num_drafts=sw[0], num_draft_tokens=sw[1], num_accepted_tokens=sw[2],
                                               accepted_per_pos=pos, interval_s=elapsed, engine=self.labels["engine"])
            self._spec_win, self._spec_win_pos = [0, 0, 0], [0] * self.num_speculative_tokens
            stats_logger.info(spec_line)
            line += "\n" + spec_line
        return line

    def on_output(self, out, now: float | None = None) -> None:
        """Account one ``RequestOutput`` of a step: first-token, inter-token and, when finished, per-request histograms."""
        now = time.monotonic() if now is None else now
        t = self._timings.get(out.request_id)
        if t is None:
            return
        new_tokens = sum(len(c.delta_token_ids) for c in out.outputs)
        if new_tokens:
            if t.first_token is None:
                t.first_token = now
                self.ttft.observe(now - t.arrival)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.prompt_tokens_cached.inc(out.num_cached_tokens)
            elif t.last_token is not None:
                self.itl.observe(now - t.last_token)
            t.last_token = now
            t.num_generated += new_tokens
        if out.finished:
            self._timings.pop(out.request_id, None)
            m = out.metrics
            self.e2e.observe(now - t.arrival)
            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
            if t.first_token is not None:
                self.request_prefill_kv_computed.observe(len(out.prompt_token_ids) - max(out.num_cached_tokens, 0))
            num_gen = sum(len(c.token_ids) for c in out.outputs)
            self.request_generation_tokens.observe(num_gen)
            first_sched = getattr(m, "first_scheduled_time", None) if m is not None else None
            first_token = t.first_token
            if first_sched is not None:
                self.queue_time.observe(max(first_sched - t.arrival, 0.0))
                if first_token is not None:
                    self.prefill_time.observe(max(first_token - first_sched, 0.0))
            if first_token is not None:
                self.decode_time.observe(max(now - first_token, 0.0))
                per_seq = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
                if per_seq > 1:
                    tpot = (now - first_token) / (per_seq - 1)
                    self.tpot.observe(tpot)
                    self.tpot_legacy.observe(tpot)
            reasons = {c.finish_reason for c in out.outputs}
            reason = "abort" if "abort" in reasons else ("length" if "length" in reasons else "stop")
            self._request_success.labels(**self.labels, finished_reason=reason).inc()

    def on_abort(self, request_id: str) -> None:
        """The request was aborted (client gone, drain timeout) before it finished."""
        if self._timings.pop(request_id, None) is not None:
            self._request_success.labels(**self.labels, finished_reason="abort").inc()

    def render(self) -> bytes:
        """Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
