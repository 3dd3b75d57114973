"""Must-show 5 (issue 37): every flag the command line accepts carries its value to where it acts —
EngineConfig, the HTTP layer's ServerSettings or uvicorn's settings. The flag list is derived from the
parser itself: a flag dropped on the way (``--seed`` left out of ENGINE_FIELDS, say) or a new flag nobody
wired fails here."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest

from kvfleet_server.flags import build_parser, engine_config, parse_flags

from kvfleet_server.cli import server_settings, uvicorn_settings
from kvfleet_server.config import EngineConfig, KVEventsConfig
from kvfleet_server.errors import UnsupportedFeatureError

ENGINE = {f.name for f in fields(EngineConfig)}
#: flag dest → how ServerSettings / uvicorn's settings show it
SERVER = {
    "served_model_name": lambda s, u: s.served_model_names, "api_key": lambda s, u: s.api_key,
    "max_queue_len": lambda s, u: s.max_queue_len, "shutdown_timeout": lambda s, u: s.shutdown_timeout,
    "chat_template": lambda s, u: s.chat_template, "allowed_origins": lambda s, u: s.cors["allow_origins"],
    "allowed_methods": lambda s, u: s.cors["allow_methods"], "allowed_headers": lambda s, u: s.cors["allow_headers"],
    "allow_credentials": lambda s, u: s.cors["allow_credentials"],
    "enable_auto_tool_choice": lambda s, u: s.enable_auto_tool_choice,
    "tool_call_parser": lambda s, u: s.tool_call_parser, "disable_log_stats": lambda s, u: not s.log_stats,
    "host": lambda s, u: u["host"], "port": lambda s, u: u["port"], "root_path": lambda s, u: u["root_path"],
    "uvicorn_log_level": lambda s, u: u["log_level"], "disable_uvicorn_access_log": lambda s, u: not u["access_log"],
    "kv_events_config": lambda s, u: s.kv_events_config,
}
#: accepted and documented as changing nothing in kvfleet (docs/server.md), or read by main() for logging
NO_EFFECT = {"trust_remote_code", "disable_log_requests", "log_level"}
#: accepted by the parser, refused (exit 2) for any non-default value: unsupported.ENGINE_REFUSALS
REFUSED = {"revision": "main", "download_dir": "/tmp/hf", "pipeline_parallel_size": 2,
           "enable_chunked_prefill": False}
#: values that must be valid for EngineConfig (others are derived from the action's type)
VALUES = {
    "model": "/models/llama", "tokenizer": "/models/tok", "dtype": "bfloat16", "device": "cpu", "quantization": "fp8",
    "kv_cache_dtype": "fp8_e5m2", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
    "structured_outputs_config": {"max_whitespace": 1}, "compilation_config": {"level": 0},
    "attention_backend": "torch", "gpu_memory_utilization": 0.5, "shutdown_timeout": 7.5, "max_logprobs": 5,
    "served_model_name": ["m1", "m2"], "chat_template": "{{ messages }}", "allowed_origins": ["https://a.example"],
    "allowed_methods": ["GET"], "allowed_headers": ["X-A"], "tool_call_parser": "hermes", "host": "127.0.0.1",
    "api_key": "sk-x", "root_path": "/llm", "lora_modules": ["sql=/adapters/sql", '{"name": "c", "path": "/a/c"}'],
    "max_cpu_loras": 4,
    "kv_events_config": {"enable_kv_cache_events": True, "endpoint": "tcp://*:5599", "topic": "kv@pod@m"},
}
#: flags parsed into a typed value: how to compare it with the JSON given
PARSED = {"kv_events_config": lambda v: KVEventsConfig.from_dict(v),
          "lora_modules": lambda v: [{"name": "sql", "path": "/adapters/sql"}, {"name": "c", "path": "/a/c"}]}
#: flags that need another flag beside them
NEEDS = {"lora_modules": ["--enable-lora"], "max_loras": ["--enable-lora", "--max-cpu-loras", "8"],
         "enable_auto_tool_choice": ["--tool-call-parser", "hermes"]}


def _argv(action: argparse.Action, value) -> list[str]:
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(action, argparse._StoreTrueAction):
        return [flag]
    if isinstance(value, (dict, list)) and action.nargs is None:
        return [flag, json.dumps(value)]
    return [flag, *(value if isinstance(value, list) else [str(value)])]


def _value(action: argparse.Action, tmp_path):
    if action.dest == "generation_config":
        (tmp_path / "generation_config.json").write_text("{}")
        return str(tmp_path)
    if action.dest in VALUES:
        return VALUES[action.dest]
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        return not action.default
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if action.type is not None and action.type is not str:
        return (action.default or 0) + 3
    raise AssertionError(f"no test value for {action.option_strings}")


def _accepted_flags():
    return [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]


def test_every_flag_is_classified():
    dests = {a.dest for a in _accepted_flags()}
    unknown = dests - ENGINE - set(SERVER) - NO_EFFECT - set(REFUSED)
    assert not unknown, f"flags that reach nothing checked here: {sorted(unknown)}"


@pytest.mark.parametrize("action", _accepted_flags(), ids=lambda a: a.option_strings[0])
def test_flag_value_reaches_its_setting(action, tmp_path):
    extra = NEEDS.get(action.dest, [])
    if action.dest in REFUSED:
        with pytest.raises(UnsupportedFeatureError):
            parse_flags(["--model", "/models/llama", *_argv(action, REFUSED[action.dest])])
        return
    value = _value(action, tmp_path)
    argv = ["--model", "/models/llama", *_argv(action, value), *extra] if action.dest != "model" else \
        _argv(action, value)
    args = parse_flags(argv)
    value = PARSED.get(action.dest, lambda v: v)(value)
    assert getattr(args, action.dest) == value
    if action.dest in NO_EFFECT:
        return
    cfg = engine_config(args)
    if action.dest in ENGINE:
        want = value[0] if action.dest == "served_model_name" else value  # the engine reports the first name
        assert getattr(cfg, action.dest) == want, action.dest
        assert getattr(cfg, action.dest) != getattr(EngineConfig(), action.dest)
    if action.dest in SERVER:
        got = SERVER[action.dest](server_settings(args, cfg, args.chat_template), uvicorn_settings(args))
        assert got == value, action.dest
