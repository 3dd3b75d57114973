"""Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM) in plain PyTorch over a flat token batch.

All sequences of a step are concatenated into one [T] token axis (no padding): linear layers run as
one matmul over T tokens, attention goes through an ``AttentionBackend`` that reads and writes the
paged KV cache. Layer math follows transformers' modeling_llama / modeling_qwen2 (RMSNorm in float32,
rotate-half RoPE, GQA, SwiGLU); q/k/v and gate/up projections are fused for fewer matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from .config import ModelConfig
from .rope import apply_rope, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x²) + eps), computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.intermediate_size = cfg.intermediate_size

    def forward(self, h, cos, sin, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        T = h.shape[0]
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(T, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        h = h + self.o_proj(attn.reshape(T, self.q_size))
        x = self.post_attention_layernorm(h)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. ``forward`` returns final hidden states [T, hidden]; ``compute_logits``
    projects selected rows to the vocabulary in float32 ([N, vocab])."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        # Weights come from a checkpoint (loader.load_model); an explicit tensor skips Embedding's normal_()
        # init, which on the meta device imports torch._dynamo (~1 s of cold start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_rope(max_positions or cfg.max_position_embeddings)

    def init_rope(self, max_positions: int, device=None) -> None:
        """(Re)build the float32 cos/sin tables for positions [0, max_positions) on ``device``.

        The tables are computed on the CPU whatever the ambient device: under ``torch.device("meta")``
        (the loader builds the module there) meta kernels would import torch._dynamo (~1 s of cold start).
        """
        cfg = self.config
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            cos, sin = rope_cos_sin(inv_freq, max_positions)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64. kv_caches[i] = (K, V) of layer i, each
        [num_blocks, block_size, num_kv_heads, head_dim]. Returns hidden states [T, hidden].

        ``num_layers`` = L runs only the first L decoder layers, then the final norm (early exit, as
        LayerSkip / Draft&Verify self-speculation drafts: Elhoushi et al. 2024, Zhang et al. 2023);
        only layers < L read and write their KV cache. None runs every layer."""
        h = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(h.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(h.dtype).unsqueeze(1)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for layer, kv in zip(layers, kv_caches):
            h = layer(h, cos, sin, kv, meta, backend)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] → logits [N, vocab] float32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()


MODEL_REGISTRY = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": LlamaForCausalLM}
