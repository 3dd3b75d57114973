"""What kvfleet-server refuses with "not supported yet" — the one list.

Everything kvfleet cannot honour yet is refused by name, never accepted and ignored. This module is
the single source of those refusals, read by:

- ``EngineConfig.validate`` and ``kvfleet-server``'s flag check (``engine_refusals``), so the server
  exits 2 at start-up, before it binds its port;
- the OpenAI routes (``request_refusals``), which answer HTTP 400 with ``param`` = the field sent;
- ``kvfleet-operator render`` and the reconcile, which refuse an InferenceService whose rendered
  flags hit an entry (Degraded, naming the spec field) instead of creating pods that crash-loop;
- docs/server.md's table (``markdown_table``), tested to equal this list.

Pure: standard library only (the operator image has no torch). When a feature lands, delete its
entry (and the test and docs follow from the list).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


#: speculative decoding methods kvfleet-server builds (spec_decode/), and vLLM's methods it refuses by name
SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip")
UNBUILT_SPECULATIVE_METHODS = ("eagle", "eagle3", "medusa", "mtp", "mlp_speculator", "suffix", "deepseek_mtp")


@dataclass(frozen=True)
class EngineRefusal:
    """One server setting (or combination) kvfleet refuses at start-up.

    Attributes:
        flag: vLLM's command-line flag, e.g. ``"--tensor-parallel-size"``.
        field: the flag's argparse dest / EngineConfig field, e.g. ``"tensor_parallel_size"``.
        feature: what is not built, in words (the message's tail).
        refuses: predicate over the settings (field name → value; a missing field is unset).
        example: flags that hit this refusal (tests render and start a server with them).
    """

    flag: str
    field: str
    feature: str
    refuses: Callable[[Mapping[str, Any]], bool]
    example: tuple[str, ...]

    def message(self, settings: Mapping[str, Any]) -> str:
        shown = f"{self.flag} {_show(settings.get(self.field))}".strip()
        return f"not supported yet: {shown} ({self.feature})"


@dataclass(frozen=True)
class RequestRefusal:
    """One OpenAI/vLLM request field kvfleet refuses (HTTP 400, ``param`` = the field).

    Attributes:
        field: the request body's field name.
        endpoints: the endpoints that refuse it.
        feature: what is not built, in words.
        allowed: values that are accepted (the field's no-op values); anything else set is refused.
    """

    field: str
    endpoints: tuple[str, ...]
    feature: str
    allowed: tuple[Any, ...] = ()

    def refuses(self, value: Any) -> bool:
        """True when ``value`` asks for the unbuilt feature (unset, false and empty values never do)."""
        if value is None or value is False or (isinstance(value, (str, list, tuple, dict)) and not value):
            return False
        return value not in self.allowed

    def message(self) -> str:
        return f"not supported yet: {self.field} ({self.feature})"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return ""
    if isinstance(value, dict):
        import json

        return json.dumps(value, sort_keys=True)
    return str(value)


def _set(field: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda s: bool(s.get(field))


def _not(field: str, *ok: Any) -> Callable[[Mapping[str, Any]], bool]:
    return lambda s: s.get(field) is not None and s.get(field) not in ok


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BOTH = (COMPLETIONS, CHAT)

ENGINE_REFUSALS: tuple[EngineRefusal, ...] = (
    EngineRefusal("--pipeline-parallel-size", "pipeline_parallel_size", "pipeline parallelism",
                  _not("pipeline_parallel_size", 1), ("--pipeline-parallel-size", "2")),
    EngineRefusal("--speculative-config", "speculative_config",
                  f"speculative methods that need trained draft heads; built: {', '.join(SPECULATIVE_METHODS)}",
                  lambda s: isinstance(s.get("speculative_config"), dict)
                  and s["speculative_config"].get("method") in UNBUILT_SPECULATIVE_METHODS,
                  ("--speculative-config", '{"method":"eagle3","num_speculative_tokens":4}')),
    EngineRefusal("--dtype", "dtype", "float16 on CPU; use float32 or bfloat16, or a GPU",
                  lambda s: s.get("dtype") == "float16" and s.get("device") == "cpu",
                  ("--dtype", "float16", "--device", "cpu")),
    EngineRefusal("--no-enable-chunked-prefill", "enable_chunked_prefill",
                  "kvfleet always splits long prefills into chunks of --max-num-batched-tokens",
                  lambda s: s.get("enable_chunked_prefill") is False, ("--no-enable-chunked-prefill",)),
    EngineRefusal("--revision", "revision", "downloading from the Hugging Face Hub: kvfleet-server loads a local "
                  "path; an InferenceService's hf://ORG/NAME@REVISION downloads one", _set("revision"),
                  ("--revision", "main")),
    EngineRefusal("--download-dir", "download_dir", "downloading from the Hugging Face Hub: kvfleet-server loads "
                  "a local path", _set("download_dir"), ("--download-dir", "/tmp/hf")),
    EngineRefusal("--structured-outputs-config", "structured_outputs_config",
                  "structured-output backends other than xgrammar",
                  lambda s: isinstance(s.get("structured_outputs_config"), dict)
                  and s["structured_outputs_config"].get("backend", "auto") not in ("auto", "xgrammar"),
                  ("--structured-outputs-config", '{"backend": "outlines"}')),
)

REQUEST_REFUSALS: tuple[RequestRefusal, ...] = (
    RequestRefusal("logit_bias", BOTH, "logit bias"),
    RequestRefusal("bad_words", BOTH, "banned word sequences"),
    RequestRefusal("allowed_token_ids", BOTH, "restricting sampling to given token ids"),
    RequestRefusal("logits_processors", BOTH, "custom logits processors"),
    RequestRefusal("truncate_prompt_tokens", BOTH, "prompt truncation"),
    RequestRefusal("use_beam_search", BOTH, "beam search"),
    RequestRefusal("return_tokens_as_token_ids", BOTH, "token-id strings in logprobs"),
    RequestRefusal("suffix", (COMPLETIONS,), "insertion (text after the completion)"),
    RequestRefusal("echo", (CHAT,), "echoing the prompt in chat (completions accept echo)"),
    RequestRefusal("prompt_logprobs", (CHAT,), "prompt logprobs in chat (completions accept prompt_logprobs)"),
    RequestRefusal("continue_final_message", (CHAT,), "continuing the last assistant message"),
    RequestRefusal("chat_template_kwargs", (CHAT,), "chat template arguments"),
)


def engine_refusals(settings: Mapping[str, Any]) -> list[EngineRefusal]:
    """The entries of ``ENGINE_REFUSALS`` that ``settings`` (field → value) hit, in list order."""
    return [r for r in ENGINE_REFUSALS if r.refuses(settings)]


def request_refusals(endpoint: str, body: Mapping[str, Any]) -> list[RequestRefusal]:
    """The entries of ``REQUEST_REFUSALS`` that a request ``body`` (field → value) to ``endpoint`` hits."""
    return [r for r in REQUEST_REFUSALS if endpoint in r.endpoints and r.field in body and r.refuses(body[r.field])]


def markdown_table() -> str:
    """docs/server.md's table of refusals (tests/server/test_unsupported.py checks the docs carry it)."""
    rows = ["| where | refused | why / what is not built |", "|---|---|---|"]
    rows += [f"| start-up (exit 2) | `{' '.join(r.example)}` | {r.feature} |" for r in ENGINE_REFUSALS]
    rows += [f"| {', '.join(f'`{e}`' for e in r.endpoints)} (400) | `{r.field}` | {r.feature} |"
             for r in REQUEST_REFUSALS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
