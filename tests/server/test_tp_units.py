"""Pure parts of tensor parallelism: the head partition (vLLM's KV-head replication rule), CPU
placement (VLLM_CPU_OMP_THREADS_BIND), the KV pool agreement, packed GGUF slicing, and the
refusals that name their numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfleet_server import EngineConfig
from kvfleet_server.errors import UnsupportedFeatureError
from kvfleet_server.executor.engine_setup import num_blocks_for
from kvfleet_server.executor.workers import cpu_plan, parse_cpu_list
from kvfleet_server.model.config import ModelConfig
from kvfleet_server.model.layers.quant.gguf import GGUFTensor, unpack_blocks
from kvfleet_server.model.sharding import check_tp_size, tp_shard


def cfg(heads: int, kv: int, inter: int = 128, vocab: int = 1000) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab, heads * 8, inter, 2, heads, kv, 8)


def test_query_heads_split_and_kv_heads_follow_their_queries():
    c = cfg(8, 2)
    for tp in (1, 2, 4, 8):
        group = 8 // 2  # query heads per KV head
        for r in range(tp):
            s = tp_shard(c, r, tp)
            assert s.num_heads == 8 // tp
            # every local query head h attends KV head h // group, which this rank holds
            assert {h // group for h in range(*s.q_heads)} == set(range(*s.kv_heads))
    assert [tp_shard(c, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert tp_shard(c, 0, 4).num_kv_head_replicas == 2 and tp_shard(c, 0, 2).num_kv_head_replicas == 1


def test_vocab_shards_cover_the_vocabulary_with_padding():
    shards = [tp_shard(cfg(4, 4, vocab=1001), r, 4).vocab for r in range(4)]
    assert shards == [(0, 251), (251, 502), (502, 753), (753, 1004)]


@pytest.mark.parametrize("heads, kv, inter, tp, text", [
    (9, 3, 128, 2, "tensor_parallel_size=2 does not divide num_attention_heads=9"),
    (8, 6, 128, 4, "tensor_parallel_size=4 does not divide num_key_value_heads=6"),
    (12, 4, 132, 6, "tensor_parallel_size=6 is not a multiple of num_key_value_heads=4"),
    (8, 8, 100, 8, "tensor_parallel_size=8 does not divide intermediate_size=100"),
])
def test_sizes_that_cannot_split_are_refused_with_the_numbers(heads, kv, inter, tp, text):
    with pytest.raises(UnsupportedFeatureError, match=text):
        check_tp_size(cfg(heads, kv, inter), tp)


def test_cpu_plan_auto_nobind_and_explicit():
    assert cpu_plan(2, [0, 1, 2, 3], None, None) == [(None, 2), ({2, 3}, 2)]  # rank 0 stays unbound
    assert cpu_plan(3, [0, 1], "auto", None) == [(None, 1)] * 3  # fewer cores than ranks: no binding
    assert cpu_plan(2, [0, 1, 2, 3], "nobind", 1) == [(None, 1), (None, 1)]
    assert cpu_plan(2, [0, 1], "0|1", None) == [({0}, 1), ({1}, 1)]
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError, match="has 1 CPU sets for tensor_parallel_size=2"):
        cpu_plan(2, [0, 1], "0-1", None)
    with pytest.raises(ValueError, match="bad CPU list"):
        parse_cpu_list("3-1")


def test_kv_pool_is_sized_by_the_smallest_rank():
    assert num_blocks_for([10_000, 7_000, 9_000], 1000) == (7, 1)


def test_packed_gguf_rows_and_block_aligned_columns_slice_without_dequantizing():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 255, size=(6, 4 * 20), dtype=np.uint8)  # Q4_1: 20 bytes per 32 values, K = 128
    raw.view(np.float16)[:, ::10] = np.float16(0.01)  # sane d and m in every block
    raw.view(np.float16)[:, 1::10] = np.float16(-0.02)
    t = GGUFTensor("Q4_1", raw, (6, 128))
    full = t.dequantize()
    rows = t.narrow(0, 2, 3)
    assert isinstance(rows, GGUFTensor) and torch.equal(rows.dequantize(), full[2:5])
    cols = t.narrow(1, 64, 32)
    assert isinstance(cols, GGUFTensor) and torch.equal(cols.dequantize(), full[:, 64:96])
    unaligned = t.narrow(1, 8, 32)  # not on a block boundary: dequantized
    assert isinstance(unaligned, torch.Tensor) and torch.equal(unaligned, full[:, 8:40])
    padded = t.pad(0, 8)
    assert padded.shape == (8, 128) and torch.equal(padded.dequantize()[6:], torch.zeros(2, 128))
    q, s, m = unpack_blocks(cols)
    assert q.shape == (6, 32)
