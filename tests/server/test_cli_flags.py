"""kvfleet-server's flags: vLLM's names, all documented, unbuilt features refused at start."""

import subprocess
import sys

import pytest

from kvfleet_server.flags import build_parser, engine_config
from kvfleet_server.errors import UnsupportedFeatureError

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
    ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'],
    ["--pipeline-parallel-size", "2"],
])
def test_unbuilt_features_are_refused_at_start(args):
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--port", "1", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "not supported yet" in out.stderr


@pytest.mark.parametrize("args, text", [
    (["--quantization", "awq"], "quantization='awq' (an already-quantized checkpoint format"),
    (["--quantization", "fp4"], "quantization='fp4'; expected one of ['fp8', 'int8', 'int4', 'gguf']"),
    (["--model", "/models/llama-dir", "--quantization", "gguf"], "quantization='gguf' needs a .gguf model file"),
    (["--kv-cache-dtype", "fp8_e3m4"], "kv_cache_dtype='fp8_e3m4'; expected one of ['auto', 'fp8', 'fp8_e4m3'"),
])
def test_refused_quantization_exits_2_naming_the_field(args, text):
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--port", "1", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-500:]
    assert text in out.stderr


def test_bad_values_name_the_flag():
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--speculative-config", "{bad"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--speculative-config" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--swap-space", "4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --swap-space" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--max-num-seqs", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--max-num-seqs" in out.stderr


def test_model_that_cannot_load_exits_non_zero_with_the_reason(tmp_path):
    from server_fixtures import free_port

    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--host", "127.0.0.1", "--port", str(free_port()),
                          "--model", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "error: loading the model failed" in out.stderr and "missing" in out.stderr


def test_engine_threads_default_to_the_usable_cpus(monkeypatch):
    from kvfleet_server import threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 8)
    assert engine_config(build_parser().parse_args([])).num_threads == 8
    assert engine_config(build_parser().parse_args(["-tp", "2"])).num_threads == 4
    assert engine_config(build_parser().parse_args(["--num-threads", "3"])).num_threads == 3
    monkeypatch.setattr(threads, "available_cpus", lambda: 1)
    assert engine_config(build_parser().parse_args([])).num_threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine_config(build_parser().parse_args([])).num_threads is None  # torch reads OMP_NUM_THREADS itself


# ------------------------------------------------------------------ real vLLM command lines

# Command lines as vLLM users write them (vLLM's docs: quickstart, OpenAI-compatible server, engine args,
# production-stack/KServe-style deployments). None: kvfleet-server accepts it with vLLM's meaning;
# a string: kvfleet refuses it, and the error names that flag.
VLLM_COMMAND_LINES = [
    ("meta-llama/Llama-3.1-8B-Instruct", None),  # `vllm serve MODEL`
    ("--model /models/llama --gpu-memory-utilization 0.9 --enable-prefix-caching --max-num-seqs 256 "
     "--max-num-batched-tokens 8192 --max-model-len 8192 --port 8000 --served-model-name llama", None),
    ("/models/llama --host 0.0.0.0 --port 8000 --dtype bfloat16 --seed 42 --api-key sk-test --uvicorn-log-level info",
     None),
    ("--model /models/llama --chat-template /tmp/template.jinja --trust-remote-code --disable-log-requests "
     "--max-logprobs 50 --root-path /llm --allowed-origins '[\"https://chat.example\"]'", None),
    ("--model /models/llama --enforce-eager --enable-chunked-prefill --disable-log-stats --generation-config vllm "
     "--served-model-name llama llama-3.1 --block-size 16 --no-enable-prefix-caching", None),
    ("--model /models/llama.Q4_1.gguf --max-num-seqs 512 --max-queue-len 100 --shutdown-timeout 60 -q gguf", None),
    ("--model /models/llama-70b --tensor-parallel-size 4 --gpu-memory-utilization 0.95", None),
    ("--model /models/llama-70b -tp 2", None),
    ("--model /models/llama --pipeline-parallel-size 2", "--pipeline-parallel-size"),
    ("--model /models/llama-70b --quantization fp8 --max-model-len 32768", None),
    ("--model /models/llama --kv-cache-dtype fp8", None),
    ("--model /models/llama --quantization awq", "quantization='awq'"),
    ("--model /models/llama --kv-cache-dtype fp8_e3m4", "kv_cache_dtype='fp8_e3m4'"),
    ("--model /models/llama --speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":5,"
     "\"prompt_lookup_max\":4}'", None),
    ("--model /models/llama --speculative-config '{\"method\":\"eagle3\",\"model\":\"/models/eagle3\","
     "\"num_speculative_tokens\":5}'", "--speculative-config"),
    ("--model /models/llama --speculative-config '{\"method\":\"ngram\"}'", "num_speculative_tokens"),
    ("--model /models/llama --revision 0e9e39f249a16976918f6564b8830bc894c89659", "--revision"),
    ("--model /models/llama --download-dir /data/hf", "--download-dir"),
    ("--model /models/llama --generation-config auto", None),
    ("--model /models/llama --generation-config /no/such/dir", "--generation-config"),
    ("--model /models/llama --no-enable-chunked-prefill", "--no-enable-chunked-prefill"),
    ("--model /models/llama --enable-lora --lora-modules sql=/adapters/sql "
     "'{\"name\": \"chat\", \"path\": \"/adapters/chat\", \"base_model_name\": \"llama\"}' --max-loras 4 "
     "--max-lora-rank 64 --max-cpu-loras 8", None),
    ("--model /models/llama --dtype float16 --device cpu", "--dtype"),
    ("--model /models/llama --swap-space 16", "--swap-space"),
    ("--model /models/llama --lora-modules sql=/adapters/sql", "--lora-modules"),
    ("--model a --max-num-seqs 0", "--max-num-seqs"),
    ("--model a --speculative-config {bad", "--speculative-config"),
]


@pytest.mark.parametrize("line, refused", VLLM_COMMAND_LINES, ids=[c[0][:60] for c in VLLM_COMMAND_LINES])
def test_real_vllm_command_lines_are_accepted_or_refused_by_name(line, refused, tmp_path):
    import shlex

    from kvfleet_server.flags import FlagError, parse_flags

    argv = shlex.split(line.replace("/tmp/template.jinja", str(tmp_path / "t.jinja")))
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    if refused is None:
        args = parse_flags(argv)
        assert args.model not in (None, "")
        return
    with pytest.raises((FlagError, UnsupportedFeatureError, ValueError)) as e:
        parse_flags(argv)
    assert refused in str(e.value) or refused.lstrip("-").replace("-", "_") in str(e.value), str(e.value)


def test_accepted_vllm_flags_keep_vllms_meaning(tmp_path):
    from kvfleet_server.flags import parse_flags
    from kvfleet_server.cli import read_chat_template

    a = parse_flags(["/models/x", "--served-model-name", "a", "b", "--max-logprobs", "50", "--root-path", "/llm",
                     "--allowed-origins", '["https://chat.example"]'])
    assert a.model == "/models/x" and a.served_model_name == ["a", "b"]
    cfg = engine_config(a)
    assert cfg.max_logprobs == 50 and cfg.served_model_name == "a"
    assert (a.root_path, a.allowed_origins) == ("/llm", ["https://chat.example"])
    assert parse_flags([]).model == "smollm2" and engine_config(parse_flags([])).resolved_served_name() == "smollm2"
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}!")
    assert read_chat_template(str(f)) == "{{ messages[0].content }}!"
    assert read_chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="give the model once"):
        parse_flags(["/a", "--model", "/b"])


def test_help_shows_the_real_defaults():
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--help"], capture_output=True, text=True,
                         timeout=60, env={**__import__("os").environ, "COLUMNS": "400", "VLLM_API_KEY": "sk-secret-7"})
    text = " ".join(out.stdout.split())
    assert "sk-secret-7" not in text  # the key is never printed
    assert "(default: None)" not in text
    assert "--max-num-seqs MAX_NUM_SEQS most sequences in one batch (running requests) (default: 256)" in text
    assert "(default: 2048, raised to --max-num-seqs when that is larger)" in text
    assert "--block-size BLOCK_SIZE tokens per KV-cache block (default: 16)" in text
    assert "--max-logprobs MAX_LOGPROBS" in text and "(default: 20)" in text
    for action in build_parser()._actions:
        if action.help:
            assert action.help.count("(default") <= 1, action.option_strings
    for chunk in text.split(" -")[1:]:
        assert chunk.count("(default") <= 1, chunk


def test_api_key_help_names_exactly_the_open_endpoints():
    from kvfleet_server.api.app import OPEN_PATHS
    from kvfleet_server.flags import API_KEY_HELP

    named = {w.strip(",();") for w in API_KEY_HELP.split() if w.startswith("/")}
    assert named - {"/v1", "/tokenize", "/detokenize"} == set(OPEN_PATHS)
