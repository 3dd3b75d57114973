"""Prefix caching seen from the server (issue 7): the kvfleet:kv_cache_blocks_cached gauge, the periodic
stats log line, and cache_salt isolation through /v1/completions and /v1/chat/completions of a real
kvfleet-server on a tiny random-weight Llama (hits read from the /metrics counters)."""

import logging
import time

import httpx
import pytest

from kvfleet_server.api import ServerSettings, ServerState, build_app
from kvfleet_server.metrics import ServerMetrics, format_stats_log
from kvfleet_server.stats import IterationStats, SchedulerStats

from server_fake_engine import FakeEngine
from server_fixtures import InProcessServer, scrape, start_server

BLOCK = 16


# ------------------------------------------------------------------------------ pure: the log line

def test_format_stats_log_rates_and_percentages():
    line = format_stats_log(interval_s=10.0, prompt_tokens=2500, generation_tokens=160, num_running=3, num_waiting=1,
                            kv_cache_usage=0.256, cache_queries=4000, cache_hits=3000, total_cache_queries=8000,
                            total_cache_hits=2000)
    assert line == ("Engine 000: Avg prompt throughput: 250.0 tokens/s, Avg generation throughput: 16.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.6%, "
                    "Prefix cache hit rate: 75.0% (since start 25.0%)")


def test_format_stats_log_no_queries_is_zero_percent():
    line = format_stats_log(interval_s=4.0, prompt_tokens=0, generation_tokens=2, num_running=0, num_waiting=0,
                            kv_cache_usage=0.0, cache_queries=0, cache_hits=0, total_cache_queries=0,
                            total_cache_hits=0, engine="1")
    assert line.startswith("Engine 001: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.5 tokens/s")
    assert line.endswith("Prefix cache hit rate: 0.0% (since start 0.0%)")


def test_maybe_log_interval_window_and_silence_when_idle(caplog):
    m = ServerMetrics("m", log_stats_interval_s=10.0)
    idle, busy = SchedulerStats(), SchedulerStats(num_running=2, kv_cache_usage=0.5)
    with caplog.at_level(logging.INFO, logger="kvfleet.stats"):
        assert m.maybe_log(idle, now=100.0) is None  # starts the clock
        m.on_iteration(IterationStats(num_prompt_tokens=200, prefix_cache_queries=1000, prefix_cache_hits=800))
        assert m.maybe_log(busy, now=105.0) is None  # interval not over
        m.on_iteration(IterationStats(num_generation_tokens=50))
        line = m.maybe_log(busy, now=120.0)  # 20 s window
        assert line is not None and "Avg prompt throughput: 10.0 tokens/s" in line
        assert "Avg generation throughput: 2.5 tokens/s" in line and "Running: 2 reqs" in line
        assert "KV cache usage: 50.0%" in line and "hit rate: 80.0% (since start 80.0%)" in line
        assert m.maybe_log(idle, now=131.0) is None  # nothing happened in that window: silent
        m.on_iteration(IterationStats(prefix_cache_queries=1000, prefix_cache_hits=0))
        line = m.maybe_log(idle, now=141.0)
        assert "hit rate: 0.0% (since start 40.0%)" in line
    assert [r.getMessage() for r in caplog.records if r.name == "kvfleet.stats"] == [
        format_stats_log(interval_s=20.0, prompt_tokens=200, generation_tokens=50, num_running=2, num_waiting=0,
                         kv_cache_usage=0.5, cache_queries=1000, cache_hits=800, total_cache_queries=1000,
                         total_cache_hits=800),
        line]
    assert ServerMetrics("n", log_stats_interval_s=None).maybe_log(busy, now=1e9) is None


def test_stats_line_is_emitted_by_the_engine_thread(caplog):
    engine = FakeEngine(max_model_len=512, max_num_seqs=2, step_delay=0.01)
    state = ServerState(ServerSettings(served_model_names=["fake"]), engine=engine)
    state.metrics.log_stats_interval_s = 0.1
    with caplog.at_level(logging.INFO, logger="kvfleet.stats"), InProcessServer(build_app(state)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 40}, timeout=30)
        assert r.status_code == 200
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(r.name == "kvfleet.stats" for r in caplog.records):
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfleet.stats"]
    assert lines and all(ln.startswith("Engine 000: Avg prompt throughput: ") for ln in lines)
    assert any("Avg generation throughput: 0.0 tokens/s" not in ln for ln in lines)


# ------------------------------------------------------------------------------ the gauge

def test_blocks_cached_gauge_with_labels():
    m = ServerMetrics("m")
    m.set_scheduler_stats(SchedulerStats(num_blocks_total=10, num_blocks_free=9, num_blocks_cached=7))
    text = m.render().decode()
    assert '# TYPE kvfleet:kv_cache_blocks_cached gauge' in text
    assert 'kvfleet:kv_cache_blocks_cached{engine="0",model_name="m"} 7.0' in text
    m.set_scheduler_stats(SchedulerStats(num_blocks_total=10, num_blocks_free=10, num_blocks_cached=0))
    assert 'kvfleet:kv_cache_blocks_cached{engine="0",model_name="m"} 0.0' in m.render().decode()


# ------------------------------------------------------------------------------ real tiny server

@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = start_server(["--model", tiny_llama_dir, "--max-model-len", "1024", "--kv-cache-memory-bytes", "4000000",
                        "--served-model-name", "tiny", "--block-size", str(BLOCK), "--shutdown-timeout", "5"],
                       str(tmp_path_factory.mktemp("pc") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


def _idle_metrics(url: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        m = scrape(url)
        if (m["vllm:num_requests_running{}"] == 0 and m["vllm:num_requests_waiting{}"] == 0) \
                or time.monotonic() > deadline:
            return m


def _ask(url: str, endpoint: str, text: str, salt: str | None) -> dict:
    """One greedy 1-token request; returns the /metrics deltas of the prefix-cache counters and the gauge."""
    before = _idle_metrics(url)
    if endpoint == "completions":
        body = {"model": "tiny", "prompt": text, "max_tokens": 1}
    else:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    after = _idle_metrics(url)
    return {"queries": after["vllm:prefix_cache_queries_total{}"] - before["vllm:prefix_cache_queries_total{}"],
            "hits": after["vllm:prefix_cache_hits_total{}"] - before["vllm:prefix_cache_hits_total{}"],
            "cached": after["kvfleet:kv_cache_blocks_cached{}"] - before["kvfleet:kv_cache_blocks_cached{}"],
            "prompt_tokens": r.json()["usage"]["prompt_tokens"], "idle": after}


def test_blocks_cached_gauge_counts_the_published_prompt_blocks(server):
    m0 = _idle_metrics(server.url)
    assert m0["kvfleet:kv_cache_blocks_cached{}"] == 0
    d = _ask(server.url, "completions", "the gauge counts whole blocks of this prompt " * 9, None)
    n = d["prompt_tokens"]
    assert n > 4 * BLOCK and d["hits"] == 0 and d["queries"] == n
    # idle: every block is free again, and the full prompt blocks stay cached (the sampled token has no KV)
    assert d["cached"] == n // BLOCK
    idle = d["idle"]
    assert idle["kvfleet:kv_cache_blocks_free{}"] == idle["kvfleet:kv_cache_blocks_total{}"]
    assert 0 < idle["kvfleet:kv_cache_blocks_cached{}"] <= idle["kvfleet:kv_cache_blocks_free{}"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_cache_salt_isolates_and_same_salt_hits(server, endpoint):
    text = f"tenant isolation over {endpoint}: a long shared instruction block " * 8
    first = _ask(server.url, endpoint, text, "tenant-a")
    n = first["prompt_tokens"]
    assert first["hits"] == 0 and first["cached"] == n // BLOCK > 2
    same = _ask(server.url, endpoint, text, "tenant-a")
    assert same["queries"] == n and same["hits"] >= (n - 1) // BLOCK * BLOCK > 0
    assert same["cached"] == 0  # nothing new to publish
    other = _ask(server.url, endpoint, text, "tenant-b")
    assert other["queries"] == n and other["hits"] == 0
    assert other["cached"] == n // BLOCK  # its own blocks, none shared with tenant-a
    unsalted = _ask(server.url, endpoint, text, None)
    assert unsalted["hits"] == 0
    again_b = _ask(server.url, endpoint, text, "tenant-b")
    assert again_b["hits"] == same["hits"]


def test_no_enable_prefix_caching_server_never_hits(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, "--max-model-len", "1024", "--kv-cache-memory-bytes", "4000000",
                        "--served-model-name", "tiny", "--no-enable-prefix-caching", "--shutdown-timeout", "5"],
                       str(tmp_path / "server.log"))
    try:
        text = "the same prompt twice, with caching turned off " * 8
        for _ in range(2):
            d = _ask(srv.url, "completions", text, None)
            assert d["queries"] == 0 and d["hits"] == 0
        idle = d["idle"]
        assert idle["kvfleet:kv_cache_blocks_cached{}"] == 0
        assert idle["vllm:prefix_cache_queries_total{}"] == idle["vllm:prefix_cache_hits_total{}"] == 0
        info = [k for k in idle if k.startswith("vllm:cache_config_info{")]
        assert len(info) == 1 and "enable_prefix_caching=False" in info[0]
    finally:
        assert srv.stop() == 0, srv.log()


# ------------------------------------------------------------------------------ the benchmark's arithmetic

def _load_bench():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_cache.py"
    spec = importlib.util.spec_from_file_location("prefix_cache_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["prefix_cache_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_best_possible_hits_bound():
    best = _load_bench().best_possible_hits
    sys_prompt = list(range(100))
    prompts = [sys_prompt + [1000 + i, 7] for i in range(5)]
    assert best(prompts) == 4 * 100  # the first arrival computes the shared prefix
    assert best([sys_prompt, sys_prompt]) == 99  # the last prompt token is always computed
    assert best(prompts, history=[sys_prompt + [5]]) == 5 * 100  # already cached: every prompt can hit
    assert best([[1, 2, 3]]) == 0 and best([]) == 0
    assert best([[1, 2, 9], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]) <= 2 + 4 + 4 - 2


def test_compare_table_ratios():
    fmt = _load_bench().format_compare

    def run(caching, ttft, rps):
        return {"concurrency": 1, "prefix_caching": caching, "ttft_p50_ms": ttft, "request_throughput": rps,
                "total_token_throughput": rps * 100, "hit_rate": 0.5 if caching else 0.0,
                "best_possible_hit_rate": 0.6,
                "counters_delta": {"vllm:prefix_cache_hits_total": 50 if caching else 0,
                                   "vllm:prefix_cache_queries_total": 100 if caching else 0}}

    table = fmt([run(True, 100.0, 3.0), run(False, 1000.0, 1.0)])
    assert "| 1 | on | 100 | 3.00 | 300 | 50 / 100 | 50.0% | 60.0% |" in table
    assert "| 1 | on/off | 10.0% | 3.00x | 3.00x |" in table


# ------------------------------------------------------------------------------ vLLM's meaning of the counters

# What vLLM v1 (vllm/v1/metrics/loggers.py, stats.py) exposes after the same request sequence: two completions
# of one 49-token prompt (block size 16) and a third of a different 20-token prompt, 3 tokens each. vLLM counts
# every prompt whole in vllm:prompt_tokens_total (at its first token), the cached part in
# vllm:prompt_tokens_cached_total, and observes prompt - cached per finished request in
# vllm:request_prefill_kv_computed_tokens. A full hit stops at the last full block before the last prompt token
# (48 of 49: the last token is always computed).
VLLM_SCRAPE_DELTAS = {
    "vllm:prompt_tokens_total{}": 49 + 49 + 20,
    "vllm:prompt_tokens_cached_total{}": 48,
    "vllm:request_prefill_kv_computed_tokens_sum{}": 49 + 1 + 20,
    "vllm:request_prefill_kv_computed_tokens_count{}": 3,
    "vllm:request_prompt_tokens_sum{}": 118,
    "vllm:request_prompt_tokens_count{}": 3,
    "vllm:prefix_cache_queries_total{}": 118,
    "vllm:prefix_cache_hits_total{}": 48,
    "vllm:generation_tokens_total{}": 9,
    "vllm:request_success_total{finished_reason=length}": 3,
    "vllm:request_generation_tokens_sum{}": 9,
    "vllm:time_to_first_token_seconds_count{}": 3,
    "vllm:e2e_request_latency_seconds_count{}": 3,
}


def test_prompt_token_counters_have_vllms_meaning_with_prefix_cache_hits(server):
    before = _idle_metrics(server.url)
    shared = [1000 + i for i in range(49)]
    for prompt in (shared, shared, [3000 + i for i in range(20)]):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                             "ignore_eos": True, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
    after = _idle_metrics(server.url)
    deltas = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in VLLM_SCRAPE_DELTAS}
    assert deltas == VLLM_SCRAPE_DELTAS


@pytest.mark.parametrize("log_stats", [True, False])
def test_disable_log_stats_silences_the_periodic_line(log_stats):
    # vLLM's --disable-log-stats: kvfleet-server passes it as ServerSettings.log_stats
    from kvfleet_server.flags import parse_flags

    assert parse_flags(["--disable-log-stats"]).disable_log_stats and not parse_flags([]).disable_log_stats
    m = ServerState(ServerSettings(served_model_names=["m"], log_stats=log_stats)).metrics
    busy = SchedulerStats(num_running=1)
    m.maybe_log(busy, now=100.0)
    m.on_iteration(IterationStats(num_generation_tokens=5))
    assert (m.maybe_log(busy, now=200.0) is not None) == log_stats
