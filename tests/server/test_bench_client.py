"""kvfleet-bench: datasets, statistics, and a full run against an OpenAI-compatible server (fake engine)."""

import json
import math

import numpy as np
import pytest

from kvfleet_server.api import ServerSettings, ServerState, build_app
from kvfleet_server.bench import RequestResult, main, make_dataset, percentile, summarize

from server_fake_engine import FakeEngine
from server_fixtures import InProcessServer


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    xs = [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 4.0]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], q))


def test_datasets_are_seeded_and_shaped():
    a = make_dataset("random", 20, input_len=30, output_len=7, range_ratio=0.5, seed=3)
    assert a == make_dataset("random", 20, input_len=30, output_len=7, range_ratio=0.5, seed=3)
    assert a != make_dataset("random", 20, input_len=30, output_len=7, range_ratio=0.5, seed=4)
    assert all(15 <= len(r.prompt.split()) <= 45 and r.max_tokens == 7 and r.system is None for r in a)
    s = make_dataset("shared-prefix", 10, input_len=5, output_len=3, prefix_len=200)
    assert len({r.system for r in s}) == 1 and len(s[0].system.split()) > 200
    assert len({r.prompt for r in s}) > 1
    with pytest.raises(ValueError, match="dataset"):
        make_dataset("sharegpt", 1, 1, 1)


def test_summarize():
    rs = [RequestResult(ok=True, ttft=0.1, e2e=1.0, itl=[0.01, 0.03], prompt_tokens=10, output_tokens=3),
          RequestResult(ok=True, ttft=0.3, e2e=2.0, itl=[0.02], prompt_tokens=20, output_tokens=2),
          RequestResult(ok=False, error="HTTP 429")]
    s = summarize(rs, duration=2.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 1, 5)
    assert s["output_throughput"] == 2.5 and s["request_throughput"] == 1.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["itl_ms"]["p50"] == pytest.approx(20.0)
    assert s["errors"] == ["HTTP 429"]


@pytest.mark.parametrize("endpoint,dataset", [("completions", "random"), ("chat", "shared-prefix")])
def test_bench_against_a_server(tmp_path, endpoint, dataset, capsys):
    state = ServerState(ServerSettings(served_model_names=["fake"]), engine=FakeEngine(max_model_len=4096))
    with InProcessServer(build_app(state)) as srv:
        rc = main(["--base-url", srv.url, "--endpoint", endpoint, "--dataset", dataset, "--num-prompts", "8",
                   "--input-len", "10", "--output-len", "6", "--prefix-len", "50", "--max-concurrency", "3",
                   "--request-rate", "50", "--result-file", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png"),
                   "--no-progress"])
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0 and r["model"] == "fake"
    assert r["total_output_tokens"] == 8 * 6
    assert r["total_input_tokens"] > 8 * 10
    for k in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(r[k]) == {"mean", "p50", "p90", "p99"} and r[k]["p50"] > 0
    assert r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "TTFT" in capsys.readouterr().out


def test_bench_counts_failures(tmp_path):
    rc = main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2", "--no-progress",
               "--result-file", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1 and r["completed"] == 0 and r["failed"] == 2 and r["errors"]
