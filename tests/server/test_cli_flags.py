"""kvfleet-server's flags: vLLM's names, all documented, unbuilt features refused at start."""

import subprocess
import sys

import pytest

from kvfleet_server.cli import build_parser, engine_config

VLLM_FLAGS = ["--model", "--served-model-name", "--host", "--port", "--dtype", "--device", "--block-size",
              "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-model-len", "--max-num-seqs",
              "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching", "--quantization",
              "--kv-cache-dtype", "--tensor-parallel-size", "--speculative-config", "--api-key", "--max-queue-len",
              "--shutdown-timeout", "--seed"]


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in VLLM_FLAGS:
        assert flag in out.stdout, flag
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"


def test_defaults_match_vllm():
    a = build_parser().parse_args([])
    assert (a.host, a.port, a.shutdown_timeout, a.enable_prefix_caching) == ("0.0.0.0", 8000, 30.0, True)
    assert build_parser().parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False


def test_flags_reach_engine_config():
    a = build_parser().parse_args(["--block-size", "32", "--max-model-len", "512", "--max-num-seqs", "3",
                                   "--no-enable-prefix-caching", "--served-model-name", "m1", "m2",
                                   "--kv-cache-memory-bytes", "1000000", "--dtype", "bfloat16", "--device", "cpu"])
    cfg = engine_config(a)
    assert (cfg.block_size, cfg.max_model_len, cfg.max_num_seqs, cfg.enable_prefix_caching) == (32, 512, 3, False)
    assert (cfg.served_model_name, cfg.kv_cache_memory_bytes, cfg.dtype, cfg.device) == ("m1", 1000000, "bfloat16", "cpu")


@pytest.mark.parametrize("args", [
    ["--tensor-parallel-size", "2"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
    ["--quantization", "awq"],
    ["--kv-cache-dtype", "fp8"],
])
def test_unbuilt_features_are_refused_at_start(args):
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--port", "1", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "not supported yet" in out.stderr


def test_bad_values_name_the_flag():
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--speculative-config", "{bad"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--speculative-config" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--max-num-seqs", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--max-num-seqs" in out.stderr


def test_model_that_cannot_load_exits_non_zero_with_the_reason(tmp_path):
    from server_fixtures import free_port

    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--host", "127.0.0.1", "--port", str(free_port()),
                          "--model", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "error: loading the model failed" in out.stderr and "missing" in out.stderr


def test_engine_threads_leave_a_cpu_to_the_http_side(monkeypatch):
    from kvfleet_server import cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cli, "available_cpus", lambda: 8)
    assert engine_config(build_parser().parse_args([])).num_threads == 7
    assert engine_config(build_parser().parse_args(["--num-threads", "3"])).num_threads == 3
    monkeypatch.setattr(cli, "available_cpus", lambda: 1)
    assert engine_config(build_parser().parse_args([])).num_threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine_config(build_parser().parse_args([])).num_threads is None  # torch reads OMP_NUM_THREADS itself
