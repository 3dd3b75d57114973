"""``--quantization gguf`` (the default for a .gguf file): GGUF tensors kept packed in memory.

Formats mapped exactly onto kvfleet's kernels (block of 32 values along K; d, m float16 per block):
- Q4_1: w = d · q + m, q ∈ [0, 15]            → int4 group scale s = d, min m (``int4_layout``)
- Q4_0: w = d · (q − 8)                       → int4 group scale s = d, min m = −8 d
- Q8_0: w = d · q, q ∈ [−127, 127] (int8)     → int8 with one scale per group of 32:
  bf16/fp16 activations on the CPU run ``_weight_int8pack_mm`` once per group (K/32 calls of K=32,
  partial sums accumulated in float32), float32 dequantizes per matmul (exact).
Block layouts follow ggml (ggml-common.h): Q4_x stores element j < 16 in the low nibble of byte j
and element j + 16 in its high nibble. Any other GGUF type (K-quants, Q5_x, F16...) and a fused layer
whose shards differ in type are dequantized at load with the ``gguf`` package, as before.

Embeddings (``token_embd``) use the same storage; a lookup gathers the rows and dequantizes them
(Q4 embeddings keep the exact nibble layout, which supports row gathers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..linear import QuantMethod, set_weight_attrs
from . import int4_layout

GROUP = 32
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass
class GGUFTensor:
    """One GGUF tensor kept in its file encoding.

    Attributes:
        type_name: ggml type name ("Q4_1", ...).
        raw: [rows, bytes_per_row] uint8 blocks, rows = output channels (a view of the file mapping).
        shape: logical (rows, cols) of the dequantized matrix.
    """

    type_name: str
    raw: np.ndarray
    shape: tuple[int, int]

    def narrow(self, dim: int, start: int, length: int):
        """Rows (dim 0) or columns (dim 1) [start, start + length) — packed when the columns fall on
        32-value block boundaries, else a dequantized float32 tensor (tensor-parallel shards)."""
        rows, cols = self.shape
        if dim == 0:
            return GGUFTensor(self.type_name, self.raw[start:start + length], (length, cols))
        bb = _BLOCK_BYTES.get(self.type_name)
        if bb is None or start % GROUP or length % GROUP or self.raw.shape[1] != cols // GROUP * bb:
            return self.dequantize().narrow(1, start, length)
        return GGUFTensor(self.type_name, self.raw[:, start // GROUP * bb:(start + length) // GROUP * bb],
                          (rows, length))

    def pad(self, dim: int, length: int) -> "GGUFTensor":
        """Zero rows appended up to ``length`` rows (dim 0; an all-zero block decodes to 0.0)."""
        if dim != 0:
            raise ValueError("GGUF tensors are padded along their rows only")
        rows, cols = self.shape
        extra = np.zeros((length - rows, self.raw.shape[1]), dtype=self.raw.dtype)
        return GGUFTensor(self.type_name, np.concatenate([self.raw, extra]), (length, cols))

    def dequantize(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType, dequantize

        w = dequantize(self.raw, GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.array(w, dtype=np.float32).reshape(self.shape))


def unpack_blocks(t: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode Q4_0/Q4_1/Q8_0 blocks → (q [N, K], s [N, K/32] float32, m [N, K/32] float32 or empty).

    Q4_x: q uint8 in [0, 15] with w = q · s + m. Q8_0: q int8 with w = q · s (m is empty).
    Raises ValueError for another type or K not a multiple of 32.
    """
    N, K = t.shape
    if t.type_name not in PACKED_TYPES or K % GROUP:
        raise ValueError(f"cannot unpack GGUF {t.type_name} tensor of shape {list(t.shape)}")
    G = K // GROUP
    blocks = np.ascontiguousarray(t.raw).reshape(N, G, _BLOCK_BYTES[t.type_name])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if t.type_name == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(N, K)
        return q, d, torch.empty(0)
    off = 2 if t.type_name == "Q4_0" else 4
    qs = torch.from_numpy(blocks[..., off:].copy())  # [N, G, 16]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(N, K)
    if t.type_name == "Q4_0":
        m = -8.0 * d
    else:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return q, d, m


class GGUFLinearMethod(QuantMethod):
    """Packed GGUF weights for a Linear (or the vocabulary embedding with ``for_embedding``)."""

    name = "gguf"

    def __init__(self, act_dtype: torch.dtype, for_embedding: bool = False):
        self.act_dtype = act_dtype
        self.for_embedding = for_embedding

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        # a placeholder: the shards arrive in their file encoding and are packed after loading
        w = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(w, weight_loader=functools.partial(self._load_shard, layer), output_dim=None, input_dim=None)
        layer.register_parameter("weight", w)
        layer.gguf_shards = {}
        layer.params_dtype = params_dtype

    @staticmethod
    def _load_shard(layer, param, loaded, shard_id=None) -> None:
        loaded = layer.tp_slice(loaded, shard_id)
        start, rows = layer.shard_offset(shard_id)
        if tuple(loaded.shape) != (rows, layer.input_size):
            raise ValueError(f"{layer.prefix or 'Linear'}: GGUF tensor of shape {list(loaded.shape)} does not fit "
                             f"shard {shard_id} of shape {[rows, layer.input_size]}")
        layer.gguf_shards[shard_id] = loaded

    def process_weights_after_loading(self, layer) -> None:
        shards = [layer.gguf_shards[k] for k in sorted(layer.gguf_shards, key=lambda k: -1 if k is None else k)]
        del layer.gguf_shards
        del layer.weight
        types = {s.type_name if isinstance(s, GGUFTensor) else "float" for s in shards}
        kind = types.pop() if len(types) == 1 else "mixed"
        if kind not in PACKED_TYPES or layer.input_size % GROUP:
            w = torch.cat([s.dequantize() if isinstance(s, GGUFTensor) else s.float() for s in shards])
            layer.register_parameter("weight", nn.Parameter(w.to(layer.params_dtype), requires_grad=False))
            layer.gguf_kind = "float"
            return
        parts = [unpack_blocks(s) for s in shards]
        q = torch.cat([p[0] for p in parts])
        s = torch.cat([p[1] for p in parts])
        if kind == "Q8_0":
            layer.gguf_kind = "q8"
            layer.q8_grouped = int4_layout.use_cpu_kernel(q.device, self.act_dtype)
            if layer.q8_grouped:  # [G, N, 32] int8 and [G, N] scales: one int8pack_mm per group
                G = s.shape[1]
                layer.register_buffer("qweight", q.view(-1, G, GROUP).transpose(0, 1).contiguous(), persistent=False)
                layer.register_buffer("scales", s.t().to(self.act_dtype).contiguous(), persistent=False)
            else:
                layer.register_buffer("qweight", q.contiguous(), persistent=False)
                layer.register_buffer("scales", s.contiguous(), persistent=False)
            return
        layer.gguf_kind = "q4"
        m = torch.cat([p[2] for p in parts])
        int4_layout.store(layer, q, s, m, torch.float32 if self.for_embedding else self.act_dtype)

    # --- kernels --------------------------------------------------------------------------------
    def apply(self, layer, x, bias):
        kind = layer.gguf_kind
        if kind == "float":
            return F.linear(x, layer.weight, bias)
        if kind == "q4":
            y = int4_layout.matmul(layer, x)
        elif layer.q8_grouped:
            y = None
            for g in range(layer.qweight.shape[0]):
                part = torch.ops.aten._weight_int8pack_mm(x[:, g * GROUP:(g + 1) * GROUP].contiguous(),
                                                          layer.qweight[g], layer.scales[g]).float()
                y = part if y is None else y.add_(part)
            y = y.to(x.dtype)
        else:
            y = F.linear(x, self.dequantize(layer, x.dtype))
        return y if bias is None else y + bias

    def dequantize(self, layer, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Weight rows (all, or ``rows`` [T] int64) as floats [T, K]; the exact GGUF formula."""
        kind = layer.gguf_kind
        if kind == "float":
            w = layer.weight if rows is None else layer.weight[rows]
            return w.to(dtype)
        if kind == "q4":
            if rows is None or layer.int4_cpu_kernel:  # the kernel's packing has no row gather
                w = int4_layout.dequantize(layer, dtype)
                return w if rows is None else w[rows]
            sub = _RowView(layer.qweight[rows], layer.scales[rows], layer.mins[rows], layer)
            return int4_layout.dequantize(sub, dtype)
        if layer.q8_grouped:
            q = layer.qweight if rows is None else layer.qweight[:, rows]  # [G, T, 32]
            s = layer.scales if rows is None else layer.scales[:, rows]  # [G, T]
            w = q.float() * s.float()[..., None]
            return w.transpose(0, 1).reshape(w.shape[1], -1).to(dtype)
        q = layer.qweight if rows is None else layer.qweight[rows]
        s = layer.scales if rows is None else layer.scales[rows]
        w = q.view(q.shape[0], -1, GROUP).float() * s[..., None]
        return w.view(q.shape[0], -1).to(dtype)

    def embedding(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize(layer, self.act_dtype, ids)


class _RowView:
    """The exact int4 nibble layout of a subset of rows (for embedding lookups)."""

    int4_cpu_kernel = False

    def __init__(self, qweight, scales, mins, layer):
        self.qweight, self.scales, self.mins = qweight, scales, mins
        self.int4_k_padded = layer.int4_k_padded
