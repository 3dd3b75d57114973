"""Attention backend interface over the paged KV cache, and the per-step metadata it reads.

KV cache layout (per layer): K and V are each a tensor ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``, i.e. flat slot ``block_id * block_size + offset``.

Token order in a step's flat batch: first the decode tokens (one per decoding sequence), then the
prefill chunks one after another. A backend must (1) write the new K/V rows to their slots
(``slot_mapping``) and (2) compute causal attention of every query token over its sequence's cached
prefix plus the chunk itself. GPU kernels plug in by implementing ``AttentionBackend.forward``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

#: slot of a padded row: its K/V are not written (vLLM's PAD_SLOT_ID)
PAD_SLOT_ID = -1


@dataclass
class PrefillSpan:
    """One prefill chunk in the flat batch.

    Attributes:
        q_start, q_len: rows [q_start, q_start + q_len) of the flat batch.
        ctx_len: tokens of the sequence in the cache once this chunk is written (prefix + q_len).
        block_table: [ceil(ctx_len / block_size)] int64 block ids.
        mask: None when the chunk starts at position 0 (plain causal attention over the chunk),
            else [q_len, ctx_len] bool, True where query i may attend key j (j <= prefix + i).
    """

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def prefix_len(self) -> int:
        return self.ctx_len - self.q_len


@dataclass
class DecodeGroup:
    """Consecutive single-token decodes of similar context length, attended in one batched call.

    Attributes:
        start, count: rows [start, start + count) of the flat batch.
        block_tables: [count, max_blocks] int64 (padded with a valid block id; masked out).
        mask: [count, 1, 1, max_blocks * block_size] bool, True for key positions < context length
            (the torch backend's SDPA key-padding mask).
        context_lens: [count] int64 context lengths (the new token included; the kernels of the CPU
            and Triton backends read these).
    """

    start: int
    count: int
    block_tables: torch.Tensor
    mask: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step; built once, shared by all layers.

    Attributes:
        slot_mapping: [T] int64 flat KV slot of each token of the batch.
        num_decodes: D, the first D tokens are single-token decodes, split into ``decode_groups``
            (sorted by context length so that padding to the group's longest context stays small).
        prefills: the prefill chunks after the decodes.
        kv_calibrate: an FP8 KV cache still has uncalibrated layers (scale 0): the backend sets their
            scales from this step's K/V. False after the first step, so steady-state steps never read a
            scale back to the host.
    """

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    kv_calibrate: bool = False
    has_pad_slots: bool = False
    backend_cache: dict = field(default_factory=dict)


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged cache."""

    name: str = "abstract"
    #: its forward can be captured in a CUDA graph (static shapes, no host synchronisation, PAD_SLOT_ID
    #: rows skipped on the device)
    supports_cuda_graphs: bool = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (new tokens);
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (written in place).
        kv_scales: None for a cache in the model dtype; for an FP8 cache the layer's float32 [2]
        (k_scale, v_scale), 0 until calibrated (see ``kv_quant``).
        Returns [T, num_heads, head_dim]."""
