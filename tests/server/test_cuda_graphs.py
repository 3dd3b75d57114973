"""CUDA-graph bookkeeping on the CPU: captured batch sizes, padding to the next size, the static
buffers, that padded rows never write KV, and the pool-sizing arithmetic. The capture and replay
themselves need CUDA (benchmarks/gpu/check.sh): here ``use_eager`` runs the graph's forward over the
same static buffers without a graph."""

from __future__ import annotations

import torch

from kvfleet_server import SamplingParams
from kvfleet_server.executor.cuda_graphs import (DecodeGraphs, capture_sizes, graph_memory_bytes,
                                                 padded_batch_size, static_buffer_bytes)
from kvfleet_server.executor.engine_setup import kv_budget_bytes

from engine_helpers import run_to_completion


def test_capture_sizes_follow_vllm():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1024)[-1] == 512
    assert capture_sizes(1) == [1]


def test_padding_to_the_next_captured_size():
    sizes = capture_sizes(20)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [1, 2, 4, 8, 8, 16, 20, 20]
    assert padded_batch_size(21, sizes) is None  # larger batches run eagerly


def test_memory_arithmetic():
    assert static_buffer_bytes(8, 10, 64, torch.bfloat16) == 8 * 8 * 14 + 8 * 64 * 2
    assert graph_memory_bytes(1000, 8, 10, 64, torch.float32) == 1000 + 8 * 8 * 14 + 8 * 64 * 4
    # 0.9 of 100 GiB, 20 GiB in use (weights, context), 3 GiB activations, 1 GiB graphs
    G = 2**30
    assert kv_budget_bytes(100 * G, 80 * G, 0.9, 3 * G, 1 * G) == 90 * G - 20 * G - 3 * G - 1 * G
    assert kv_budget_bytes(100 * G, 10 * G, 0.9, 3 * G) < 0  # nothing left: the caller raises


def _tokens(engine, prompts, n=5):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = run_to_completion(engine)
    return [out[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def test_padded_decode_path_same_tokens_and_no_kv_writes_from_padding(tiny_engine_factory):
    prompts = ["a b c d e f g h i j k l m n o p q r s", "Hello there", "x y z"]
    ref = _tokens(tiny_engine_factory(block_size=8), prompts)

    eng = tiny_engine_factory(block_size=8)
    runner = eng.runner
    graphs = DecodeGraphs(runner, capture_sizes(8), max_blocks_per_seq=16)
    graphs.use_eager()
    launched = []
    for B in list(graphs.launch):
        f = graphs.launch[B]
        graphs.launch[B] = (lambda B=B, f=f: (launched.append(B), f()))
    runner.graphs = graphs

    # every decode step: the KV rows written are exactly the real rows' slots
    real_run = runner.run

    def checked_run(inputs):
        before = [(k.clone(), v.clone()) for k, v, _ in runner.kv_caches]
        hidden = real_run(inputs)
        if graphs.can_run(inputs):
            assert graphs.slot_mapping[len(inputs.dec_slots):].eq(-1).all()  # padded rows: PAD_SLOT_ID
            for (k0, v0), (k, v, _) in zip(before, runner.kv_caches):
                changed = ((k0 != k).flatten(2).any(-1) | (v0 != v).flatten(2).any(-1)).flatten()
                written = set(changed.nonzero().flatten().tolist())
                assert written <= set(inputs.dec_slots), (written, inputs.dec_slots)
        return hidden

    runner.run = checked_run
    out = _tokens(eng, prompts)
    assert out == ref
    assert 4 in launched  # 3 decodes padded to 4
    assert graphs.hidden.shape == (8, eng.model_config.hidden_size)
    assert graphs.block_tables.shape == (8, 16)


def test_enforce_eager_and_cpu_capture_nothing(tiny_engine_factory):
    assert tiny_engine_factory().runner.graphs is None  # CPU: graphs are CUDA-only
    assert tiny_engine_factory(enforce_eager=True).runner.graphs is None
