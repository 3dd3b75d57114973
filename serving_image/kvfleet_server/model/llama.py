"""Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM) in plain PyTorch over a flat token batch.

All sequences of a step are concatenated into one [T] token axis (no padding): linear layers run as
one matmul over T tokens, attention goes through an ``AttentionBackend`` that reads and writes the
paged KV cache. Layer math follows transformers' modeling_llama / modeling_qwen2 (RMSNorm in float32,
rotate-half RoPE, GQA, SwiGLU); q/k/v and gate/up projections are fused for fewer matmuls.

Tensor parallelism (``tp`` with N > 1, partition in ``sharding.py``): each rank builds the layers with
its local head counts and channel slices — column-parallel qkv_proj / gate_up_proj, row-parallel
o_proj / down_proj (one all-reduce each, inside the Linear), vocab-parallel embedding and LM head.
Hidden states between layers are full and identical on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.backend import AttentionBackend, AttentionMetadata
from ..attention.kv_quant import rotate
from ..distributed import TPGroup
from .config import ModelConfig
from .layers.embedding import VocabEmbedding, gather_logits
from .layers.layer_ops import TORCH_OPS
from .layers.linear import Linear
from .layers.quant import QuantConfig
from .sharding import TPShard, tp_shard
from .rope import rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x²) + eps), computed in float32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TORCH_OPS.rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    #: the element-wise ops (norms, RoPE, SiLU-and-mul): the torch reference, or fused CPU kernels
    #: (``layers/layer_ops.use_layer_ops``)
    ops = TORCH_OPS

    def __init__(self, cfg: ModelConfig, layer_idx: int, quant_config: QuantConfig | None = None,
                 tp: TPGroup | None = None, shard: TPShard | None = None):
        super().__init__()
        qc = quant_config or QuantConfig(None, torch.get_default_dtype())
        tp = tp or TPGroup()
        shard = shard or tp_shard(cfg, tp.rank, tp.world_size)
        self.layer_idx = layer_idx
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        #: FP8 KV cache: the float32 Hadamard matrix [head_dim, head_dim] q, k, v and the attention output are
        #: rotated by (``attention/kv_quant.py``; set by ``LlamaForCausalLM.set_kv_rotation``), else None
        self.kv_rotation: torch.Tensor | None = None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        pre = f"layers.{layer_idx}."
        hd = self.head_dim
        self.intermediate_size = inter = shard.intermediate[1] - shard.intermediate[0]
        col = row = {}
        if tp.is_parallel:  # which rows / columns of each checkpoint tensor this rank keeps
            q0, k0 = shard.q_heads[0] * hd, shard.kv_heads[0] * hd
            col = {"qkv": [(q0, self.q_size), (k0, self.kv_size), (k0, self.kv_size)],
                   "gate_up": [(shard.intermediate[0], inter)] * 2}
            row = {"o": (q0, self.q_size), "down": (shard.intermediate[0], inter)}
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=cfg.attention_bias,
                               quant_method=qc.linear_method(), prefix=pre + "qkv_proj", tp=tp,
                               column_slices=col.get("qkv"))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, quant_method=qc.linear_method(),
                             prefix=pre + "o_proj", tp=tp, row_slice=row.get("o"))
        self.gate_up_proj = Linear(cfg.hidden_size, [inter] * 2, quant_method=qc.linear_method(),
                                   prefix=pre + "gate_up_proj", tp=tp, column_slices=col.get("gate_up"))
        self.down_proj = Linear(inter, cfg.hidden_size, quant_method=qc.linear_method(),
                                prefix=pre + "down_proj", tp=tp, row_slice=row.get("down"))

    def forward(self, h, cos, sin, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        """One layer, eagerly: ``layer_pre_attention`` → attention backend → ``layer_post_attention``."""
        q, k, v = layer_pre_attention(self, h, cos, sin)
        attn = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, kv_scales=kv_cache[2])
        return layer_post_attention(self, h, attn)


# A layer is two pieces around its attention call, so that ``model/compile.py`` can hand each to
# torch.compile (Inductor) while the paged attention backend stays an eager, pluggable call (vLLM's
# piecewise compilation). ``LlamaForCausalLM.pieces`` holds the pair the forward pass uses: these
# functions (eager), or their compiled versions.
def layer_pre_attention(layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """h [T, hidden] → q [T, heads, head_dim], k, v [T, kv_heads, head_dim]: RMSNorm → fused qkv
    projection → RoPE of one layer."""
    T, ops, norm = h.shape[0], layer.ops, layer.input_layernorm
    qkv = layer.qkv_proj(ops.rms_norm(h, norm.weight, norm.eps))
    q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    q, k = ops.rope(q.view(T, layer.num_heads, layer.head_dim), k.view(T, layer.num_kv_heads, layer.head_dim),
                    cos, sin)
    v = v.reshape(T, layer.num_kv_heads, layer.head_dim)
    if layer.kv_rotation is not None:  # FP8 KV cache: q·k and the weighted sum of v are unchanged
        r = layer.kv_rotation
        q, k, v = rotate(q, r), rotate(k, r), rotate(v, r)
    return q, k, v


def layer_post_attention(layer: DecoderLayer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual h [T, hidden] and attention output [T, heads, head_dim] → next residual [T, hidden]:
    o_proj + residual → RMSNorm → SwiGLU MLP + residual of one layer."""
    ops, norm = layer.ops, layer.post_attention_layernorm
    if layer.kv_rotation is not None:  # back from the rotated basis of v (the matrix is its own inverse)
        attn = rotate(attn, layer.kv_rotation)
    x, h = ops.add_rms_norm(layer.o_proj(attn.reshape(h.shape[0], layer.q_size)), h, norm.weight, norm.eps)
    return h + layer.down_proj(ops.silu_and_mul(layer.gate_up_proj(x)))


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. ``forward`` returns final hidden states [T, hidden]; ``compute_logits``
    projects selected rows to the vocabulary in float32 ([N, vocab]).

    ``quant_config`` picks each projection's storage and kernel (loader.load_model builds it from
    --quantization); the layers below never branch on the format.

    ``tp``: this rank's TPGroup (None: no tensor parallelism). Raises UnsupportedFeatureError when the
    head counts cannot split over ``tp.world_size`` (see ``sharding.check_tp_size``)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, quant_config: QuantConfig | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.config = cfg
        qc = quant_config or QuantConfig(None, torch.get_default_dtype())
        self.tp = tp = tp or TPGroup()
        self.shard = shard = tp_shard(cfg, tp.rank, tp.world_size)
        first, end = shard.vocab
        # weights come from a checkpoint (loader.load_model): parameters are allocated uninitialized
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, qc.embedding_method(), tp=tp,
                                           vocab_range=shard.vocab)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, qc, tp, shard) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, quant_method=qc.lm_head_method(), prefix="lm_head", tp=tp,
            column_slices=[(first, end - first)] if tp.is_parallel else None)
        self.init_rope(max_positions or cfg.max_position_embeddings)
        #: (pre-attention, post-attention) callables of every layer: eager, or compiled (model/compile.py)
        self.pieces = (layer_pre_attention, layer_post_attention)
        self.compiled = False
        self.layer_ops = TORCH_OPS  # see DecoderLayer.ops

    def set_kv_rotation(self, rotation: torch.Tensor | None, layers) -> None:
        """Rotate q, k, v and the attention output of the decoder layers numbered in ``layers`` by
        ``rotation`` ([head_dim, head_dim], orthonormal and symmetric: ``kv_quant.hadamard``), the others
        by the identity matrix (so that every layer runs the same code: one compiled graph per piece, no
        recompile at the first unrotated layer); no layer or None rotates none. For an FP8 KV cache (see
        ``attention/kv_quant.py``); in exact arithmetic the layers compute the same."""
        chosen = set(layers) if rotation is not None else set()
        identity = None
        if 0 < len(chosen) < len(self.layers):
            identity = torch.eye(rotation.shape[0], dtype=rotation.dtype, device=rotation.device)
        for i, layer in enumerate(self.layers):
            layer.kv_rotation = rotation if i in chosen else identity

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
        kv_caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64. kv_caches[i] = (K, V, kv_scales) of layer i, K and V each
        [num_blocks, block_size, num_kv_heads, head_dim], kv_scales None or float32 [2] for an FP8
        cache. Returns hidden states [T, hidden].

        ``num_layers`` = L runs only the first L decoder layers, then the final norm (early exit, as
        LayerSkip / Draft&Verify self-speculation drafts: Elhoushi et al. 2024, Zhang et al. 2023);
        only layers < L read and write their KV cache. None runs every layer."""
        h = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(h.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(h.dtype).unsqueeze(1)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        pre, post = self.pieces
        for layer, kv in zip(layers, kv_caches):
            q, k, v = pre(layer, h, cos, sin)
            attn = backend.forward(q, k, v, kv[0], kv[1], meta, layer.scale, kv_scales=kv[2])
            h = post(layer, h, attn)
        return self.layer_ops.rms_norm(h, self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] → logits [N, vocab] float32 (None on tensor-parallel ranks other than 0,
        which only contribute their vocabulary shard)."""
        head = self.embed_tokens.project if self.lm_head is None else self.lm_head
        return gather_logits(head(hidden).float(), self.config.vocab_size, self.tp)


MODEL_REGISTRY = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": LlamaForCausalLM}
