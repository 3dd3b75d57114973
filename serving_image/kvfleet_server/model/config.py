"""ModelConfig: the architecture hyper-parameters kvfleet's model code needs, read from an HF
``config.json`` dict or from GGUF metadata (see ``loader.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedFeatureError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    Attributes:
        architecture: "LlamaForCausalLM" or "Qwen2ForCausalLM".
        head_dim: per-head width; hidden_size // num_attention_heads unless the config says otherwise.
        rope_scaling: None or a dict with "rope_type" ("linear" | "llama3") and its parameters
            (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
        attention_bias: q/k/v projections carry a bias (True for Qwen2).
        eos_token_ids: token ids that end generation (config's eos_token_id, int or list).
        checkpoint_quantization: None for float weights, "fp8" when the checkpoint stores the decoder
            projections in FP8 (config.json's quantization_config; ``kvfleet_server/checkpoint_quantization.py``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    checkpoint_quantization: str | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling``
        or 5.x ``rope_parameters``). Raises UnsupportedFeatureError for an unknown architecture."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = cfg.get("model_type")
            arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(mt)
        if arch is None:
            raise UnsupportedFeatureError(
                f"not supported yet: architecture {archs or cfg.get('model_type')!r}; "
                f"expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=_normalize_rope_scaling(scaling),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


def _normalize_rope_scaling(scaling: dict | None) -> dict | None:
    if not scaling:
        return None
    s = dict(scaling)
    rtype = s.get("rope_type", s.get("type", "default"))
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedFeatureError(
            f"not supported yet: rope scaling type {rtype!r}; expected one of {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rtype == "default":
        return None
    s["rope_type"] = rtype
    return s
