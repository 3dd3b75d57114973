"""SpeculativeConfig: the ``--speculative-config`` JSON (vLLM's keys) parsed and validated.

Pure and torch-free, beside ``config.py``: ``EngineConfig.validate`` (and so ``kvfleet-operator render`` in
the operator image, which has no torch) checks a speculative config without importing ``spec_decode/``,
whose proposers need torch; ``spec_decode/`` imports it from here.

Methods kvfleet builds (``spec_decode/``): ``ngram`` (prompt lookup), ``draft_model`` (a smaller model with the same
tokenizer) and ``layer_skip`` (our name: the first L layers of the target draft). Methods that need
trained heads (eagle, eagle3, medusa, mtp, ...) are refused by name with UnsupportedFeatureError.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedFeatureError
from .unsupported import SPECULATIVE_METHODS as SUPPORTED_METHODS
from .unsupported import UNBUILT_SPECULATIVE_METHODS as UNSUPPORTED_METHODS  # refused by name

MAX_SPECULATIVE_TOKENS = 16
_COMMON = {"method", "num_speculative_tokens", "disable_by_batch_size", "min_acceptance"}
_KEYS = {
    "ngram": _COMMON | {"prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": _COMMON | {"model"},
    "layer_skip": _COMMON | {"num_draft_layers"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative decoding settings.

    Attributes:
        method: "ngram" | "draft_model" | "layer_skip".
        num_speculative_tokens: k, draft tokens verified per decoding sequence and step (1..16).
        prompt_lookup_min / prompt_lookup_max: n-gram sizes searched, longest first (ngram; vLLM's
            default when neither is given is 5 / 5; one given sets the other).
        model: path of the draft model (draft_model).
        num_draft_layers: L, target layers the drafter runs (layer_skip; 1 <= L < num_hidden_layers,
            checked by the engine once the model is known).
        disable_by_batch_size: a step with more running sequences than this does not speculate.
        min_acceptance: kvfleet's key (no vLLM equivalent): the acceptance rate below which a sequence
            stops drafting for a back-off (spec_decode/gate.py DraftGate), in [0, 1]; None = the break-even
            of the method's cost on the device (at least DraftGate.MIN_ACCEPTANCE, 0.15); 0 = always speculate.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_draft_layers: int | None = None
    disable_by_batch_size: int | None = None
    min_acceptance: float | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """Raises ValueError naming the key for bad values, UnsupportedFeatureError for methods not built."""
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        method = d.get("method")
        if method is None:
            raise ValueError(f"speculative_config.method is required (one of {', '.join(SUPPORTED_METHODS)})")
        if method in UNSUPPORTED_METHODS:
            raise UnsupportedFeatureError(
                f"not supported yet: speculative_config.method={method!r} (needs trained draft heads; built: "
                f"{', '.join(SUPPORTED_METHODS)})")
        if method not in SUPPORTED_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SUPPORTED_METHODS)}, "
                             f"got {method!r}")
        unknown = sorted(set(d) - _KEYS[method])
        if unknown:
            raise UnsupportedFeatureError(
                f"not supported yet: speculative_config key(s) {', '.join(unknown)} with method {method!r} "
                f"(accepted: {', '.join(sorted(_KEYS[method]))})")

        def integer(key: str, lo: int, hi: int | None = None, required: bool = False) -> int | None:
            v = d.get(key)
            if v is None:
                if required:
                    raise ValueError(f"speculative_config.{key} is required for method {method!r}")
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                rng = f"in [{lo}, {hi}]" if hi is not None else f"at least {lo}"
                raise ValueError(f"speculative_config.{key} must be an integer {rng}, got {v!r}")
            return v

        k = integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, required=True)
        cfg = dict(method=method, num_speculative_tokens=k,
                   disable_by_batch_size=integer("disable_by_batch_size", 1))
        ma = d.get("min_acceptance")
        if ma is not None:
            if isinstance(ma, bool) or not isinstance(ma, (int, float)) or not 0 <= ma <= 1:
                raise ValueError(f"speculative_config.min_acceptance must be a number in [0, 1], got {ma!r}")
            cfg["min_acceptance"] = float(ma)
        if method == "ngram":
            lo, hi = integer("prompt_lookup_min", 1), integer("prompt_lookup_max", 1)
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            cfg.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
        elif method == "draft_model":
            m = d.get("model")
            if not isinstance(m, str) or not m:
                raise ValueError("speculative_config.model (path of the draft model) is required for method "
                                 "'draft_model'")
            cfg["model"] = m
        else:
            cfg["num_draft_layers"] = integer("num_draft_layers", 1, required=True)
        return cls(**cfg)
