"""Tensor-parallel partition of a Llama-family model (pure functions, no process groups).

The Megatron-LM split (Shoeybi et al. 2019), as vLLM and nano-vllm apply it:

* column-parallel q/k/v and gate/up: rank r keeps its query heads, its KV heads, and its slice of the
  MLP's intermediate channels (output rows of the weight);
* row-parallel o_proj and down_proj: rank r keeps the matching input columns; the partial outputs are
  summed by one all-reduce each;
* vocab-parallel embedding and LM head: rank r keeps vocabulary rows
  [r * ceil(V / N), (r + 1) * ceil(V / N)) (the last shard padded with zero rows).

KV heads follow vLLM's rule: with num_kv_heads >= N each rank keeps num_kv_heads / N whole heads
(N must divide num_kv_heads); with num_kv_heads < N, N must be a multiple of num_kv_heads and each
KV head is replicated on N / num_kv_heads ranks, so every rank keeps exactly one whole head — the one
its query heads attend to. Sizes that cannot split are refused with the numbers.

The slicing itself happens in the one ``Linear`` (``layers/linear.py``: ``column_slices`` /
``row_slice``, cut by every parameter's ``weight_loader``); ``llama.py`` turns a ``TPShard`` into them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedFeatureError
from .config import ModelConfig


@dataclass(frozen=True)
class TPShard:
    """What rank ``rank`` of ``world_size`` holds.

    Attributes:
        num_heads / num_kv_heads: query and KV heads on this rank.
        q_heads: (first, end) global query-head range; kv_heads: (first, end) global KV-head range.
        num_kv_head_replicas: ranks holding each KV head (1 unless num_kv_heads < world_size).
        intermediate: (first, end) of the MLP's intermediate channels.
        vocab: (first, end) of the vocabulary rows owned (end may exceed vocab_size: padding).
    """

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    num_kv_head_replicas: int
    intermediate: tuple[int, int]
    vocab: tuple[int, int]


def check_tp_size(cfg: ModelConfig, world_size: int) -> None:
    """Raise UnsupportedFeatureError naming the numbers when the model cannot split over ``world_size``."""
    n, h, kv, inter = world_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if h % n:
        raise UnsupportedFeatureError(
            f"tensor_parallel_size={n} does not divide num_attention_heads={h}: each rank needs whole query heads "
            f"(possible sizes: {[d for d in range(1, h + 1) if h % d == 0]})")
    if kv >= n and kv % n:
        raise UnsupportedFeatureError(
            f"tensor_parallel_size={n} does not divide num_key_value_heads={kv}: each rank needs whole KV heads")
    if kv < n and n % kv:
        raise UnsupportedFeatureError(
            f"tensor_parallel_size={n} is not a multiple of num_key_value_heads={kv}: KV heads can only be "
            f"replicated a whole number of times")
    if inter % n:
        raise UnsupportedFeatureError(
            f"tensor_parallel_size={n} does not divide intermediate_size={inter}")


def tp_shard(cfg: ModelConfig, rank: int, world_size: int) -> TPShard:
    """The partition of rank ``rank``; raises UnsupportedFeatureError like ``check_tp_size``."""
    check_tp_size(cfg, world_size)
    n, h, kv = world_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hq = h // n
    if kv >= n:
        hkv, replicas = kv // n, 1
        kv_first = rank * hkv
    else:
        hkv, replicas = 1, n // kv
        kv_first = rank // replicas
    inter = cfg.intermediate_size // n
    vs = -(-cfg.vocab_size // n)
    return TPShard(rank, n, hq, hkv, (rank * hq, (rank + 1) * hq), (kv_first, kv_first + hkv), replicas,
                   (rank * inter, (rank + 1) * inter), (rank * vs, (rank + 1) * vs))
