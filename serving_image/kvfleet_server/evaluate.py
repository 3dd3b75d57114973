"""Accuracy of a served model against a reference: perplexity on fixed windows of a text every
machine has (the stdlib's ``pydoc_data.topics``, the Python reference manual), the per-token
log-likelihood change, and greedy agreement (tokens until the first divergence).

Scoring runs through the engine's prompt scoring (``max_tokens=0`` + ``prompt_logprobs=0``): the
same path as ``echo`` + ``max_tokens: 0`` + ``logprobs`` on /v1/completions. Pure functions except
where an ``LLM`` is passed in.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .sampling_params import SamplingParams


def reference_text() -> str:
    """The Python reference manual's topics (``pydoc_data.topics``), sorted by topic name, joined."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def fixed_windows(token_ids: list[int], window: int, count: int) -> list[list[int]]:
    """``count`` consecutive non-overlapping windows of ``window`` tokens from the start.
    Raises ValueError when the text is too short."""
    if window * count > len(token_ids):
        raise ValueError(f"need {window * count} tokens for {count} windows of {window}, text has {len(token_ids)}")
    return [token_ids[i * window:(i + 1) * window] for i in range(count)]


def score_windows(llm, windows: list[list[int]]) -> list[list[float]]:
    """Log-probability (natural log) of every token of each window given the tokens before it in the
    window: [windows][window − 1] floats."""
    outs = llm.generate(windows, SamplingParams(max_tokens=0, prompt_logprobs=0))
    scores = []
    for w, out in zip(windows, outs):
        lps = out.prompt_logprobs[1:]  # entry 0 (the first token) has no context
        scores.append([entry[tok].logprob for tok, entry in zip(w[1:], lps)])
    return scores


def perplexity(scores: list[list[float]]) -> float:
    """exp(− mean log-likelihood) over all scored tokens."""
    flat = [x for s in scores for x in s]
    return math.exp(-sum(flat) / len(flat))


@dataclass
class LogLikelihoodChange:
    """Per-token log-likelihood of a method minus the reference's, over the same tokens (nats)."""

    mean: float
    mean_abs: float
    max_abs: float


def loglik_change(scores: list[list[float]], ref: list[list[float]]) -> LogLikelihoodChange:
    d = [a - b for s, r in zip(scores, ref) for a, b in zip(s, r)]
    return LogLikelihoodChange(sum(d) / len(d), sum(abs(x) for x in d) / len(d), max(abs(x) for x in d))


def agreement_length(a: list[int], b: list[int]) -> int:
    """Tokens until the first divergence of two greedy continuations."""
    return len(os.path.commonprefix([a, b]))


def greedy_agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
    """Per prompt, tokens until the first divergence from the reference; mean and the fraction identical."""
    lengths = [agreement_length(o, r) for o, r in zip(outs, ref)]
    full = sum(1 for o, r, n in zip(outs, ref, lengths) if n == len(r) == len(o))
    return {"mean_tokens_until_divergence": sum(lengths) / len(lengths), "identical": full / len(lengths),
            "lengths": lengths}


_GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def export_float_checkpoint(gguf_path: str, out_dir: str) -> str:
    """Write a llama GGUF's dequantized float32 weights as a Hugging Face directory (config.json,
    model.safetensors, tokenizer files): the unquantized checkpoint that the online methods
    (fp8/int8/int4) start from, with weights identical to the dequantized GGUF. The tokenizer is
    saved by transformers (needs ``transformers`` and ``gguf``). Returns ``out_dir``.
    Raises ValueError for rope scaling or biases (not needed for the bundled model)."""
    import json
    import os

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from .model.gguf_reader import open_gguf, read_gguf_config, read_gguf_tensors

    reader = open_gguf(gguf_path)
    cfg = read_gguf_config(reader)
    if cfg.rope_scaling or cfg.attention_bias:
        raise ValueError("export_float_checkpoint handles plain-rope llama GGUFs without biases")
    tensors = {}
    for name, t in read_gguf_tensors(reader, cfg).items():
        if name.startswith("blk."):
            _, i, kind, _ = name.split(".")
            tensors[f"model.layers.{i}.{_GGUF_TO_HF[kind]}.weight"] = t
        else:
            hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}.get(name)
            if hf:
                tensors[hf] = t
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"))
    hf_cfg = {"architectures": [cfg.architecture], "model_type": "llama", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
              "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
              "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
              "torch_dtype": "float32"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=1)
    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out_dir)
    return out_dir
