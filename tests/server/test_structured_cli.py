"""kvfleet-server's structured-output and tool flags: they reach the engine config, and bad values stop the
server at start with exit status 2 and a message naming the flag (before any model is loaded)."""

import subprocess
import sys

import pytest

from kvfleet_server.flags import build_parser, engine_config


def test_flags_reach_engine_config():
    a = build_parser().parse_args(["--enable-jump-forward", "--structured-outputs-config",
                                   '{"disable_any_whitespace": true, "compile_timeout": 2}',
                                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    cfg = engine_config(a)
    assert cfg.enable_jump_forward is True
    so = cfg.resolved_structured_outputs()
    assert so["disable_any_whitespace"] is True and so["compile_timeout"] == 2 and so["max_whitespace"] == 2
    assert (a.enable_auto_tool_choice, a.tool_call_parser) == (True, "hermes")
    assert engine_config(build_parser().parse_args([])).enable_jump_forward is False


@pytest.mark.parametrize("args,words", [
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice requires --tool-call-parser"]),
    (["--tool-call-parser", "mistral"], ["--tool-call-parser", "invalid choice"]),
    (["--structured-outputs-config", '{"backend": "outlines"}'], ["not supported yet", "backend"]),
    (["--structured-outputs-config", '{"compile_timeout": 0}'], ["compile_timeout"]),
    (["--structured-outputs-config", '{"max_whitespace": -1}'], ["max_whitespace"]),
    (["--structured-outputs-config", '{"whitespace": 1}'], ["unknown key", "whitespace"]),
    (["--structured-outputs-config", "[1]"], ["--structured-outputs-config", "JSON object"]),
])
def test_bad_values_exit_2_naming_the_flag(args, words):
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--port", "1", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert all(w in out.stderr for w in words), out.stderr
