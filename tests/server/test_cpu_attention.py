"""kvfleet's C++ CPU paged-attention kernel (attention/cpu_backend.py) against the torch backend (the
oracle): every case shape the Triton kernels are checked on, float32 / bfloat16 queries, caches in the
model dtype and FP8, and whole engine runs with each backend."""

from __future__ import annotations

import os

import pytest
import torch

from kvfleet_server.attention import cpu_ext, resolve_attention_backend
from kvfleet_server.attention.parity import GQA, SEQS, compare, make_case, run_backend
from kvfleet_server.attention.torch_ref import TorchAttentionBackend

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason=f"CPU kernel not built: {cpu_ext.load_error()}")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def cpu_backend():
    from kvfleet_server.attention import CpuPagedAttentionBackend

    return CpuPagedAttentionBackend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(SEQS))
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_kernel_matches_torch_backend(cpu_backend, dtype, kind, heads):
    """Decode / extend (chunked prefill over a cached prefix) / mixed steps, GQA ratios 1, 3, 4, 8,
    non-contiguous and shared blocks, contexts not multiples of the block size: the output within
    1e-5 (fp32) / 1e-2 (bf16) relative of the oracle, the cache written bit-identically."""
    h, kvh = heads
    case = make_case(SEQS[kind], h, kvh, 16, 8, dtype, seed=len(SEQS[kind]) + h)
    res = compare(cpu_backend, TorchAttentionBackend(), case)
    assert res["rel_err"] < TOL[dtype], res
    assert res["cache_equal"]


@pytest.mark.parametrize("kv_dtype,dtype", [(torch.float8_e4m3fn, torch.float32), (torch.float8_e5m2, torch.bfloat16),
                                            (torch.float8_e4m3fn, torch.bfloat16)])
def test_kernel_fp8_cache_matches_torch_backend(cpu_backend, kv_dtype, dtype):
    """An FP8 cache dequantized on read with the layer's k/v scales, as the oracle does."""
    case = make_case(SEQS["mixed"], 8, 2, 16, 8, dtype, kv_cache_dtype=kv_dtype, seed=3)
    res = compare(cpu_backend, TorchAttentionBackend(), case)
    assert res["rel_err"] < TOL[dtype], res
    assert res["cache_equal"]


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (24, 4), (128, 32)])
def test_kernel_other_head_dims_and_block_sizes(cpu_backend, head_dim, block_size):
    seqs = [(300, 1), (5, 1), (0, 40), (150, 33)]  # long contexts: many blocks per row
    case = make_case(seqs, 9, 3, head_dim, block_size, torch.float32, seed=head_dim)
    res = compare(cpu_backend, TorchAttentionBackend(), case)
    assert res["rel_err"] < 1e-5, res


@pytest.mark.parametrize("max_span", [4, 1 << 30], ids=["default-split", "every-span-in-kernel"])
def test_kernel_spans_over_a_cached_prefix(cpu_backend, monkeypatch, max_span):
    """With the span kernel off: decodes with drafts and short chunks (<= KERNEL_MAX_SPAN rows) attend in
    the per-row kernel; with the limit lifted every span does (the kernel itself on 7-48-row spans),
    within the same tolerance."""
    from kvfleet_server.attention import cpu_backend as mod

    monkeypatch.setattr(mod, "KERNEL_MAX_SPAN", max_span)
    monkeypatch.setattr(mod, "SPAN_MIN_ROWS", 1 << 30)
    seqs = [(37, 1), (20, 2), (45, 4), (16, 5), (21, 7), (150, 48)]
    case = make_case(seqs, 9, 3, 64, 16, torch.float32, seed=7)
    rows = mod.paged_rows(case.meta)[1]
    assert len(rows) == (1 + 2 + 4 if max_span == 4 else sum(n for _, n in seqs))
    res = compare(cpu_backend, TorchAttentionBackend(), case)
    assert res["rel_err"] < 1e-5, res
    assert res["cache_equal"]


@pytest.mark.parametrize("heads", GQA + [(9, 3)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (16, 8), (32, 4)])
def test_span_kernel_matches_torch_backend(cpu_backend, heads, head_dim, block_size):
    """Float32 spans of SPAN_MIN_ROWS rows or more over a cached prefix (verifications of 3 or more drafts,
    chunks over a prefix-cache hit, 65 and 300 rows among them) attend in the span kernel: each row over its
    own context (a tile of query vectors straddles rows and heads), prefixes that are not multiples of 16 or
    of the block size, a prefix of one token — within 1e-5 of the oracle; shorter spans and contexts past
    SPAN_MAX_CONTEXT keep their paths."""
    from kvfleet_server.attention import cpu_backend as mod

    h, kvh = heads
    seqs = [(37, 1), (20, 3), (45, 4), (1, 7), (16, 16), (150, 17), (300, 64), (33, 65), (200, 300), (2100, 5)]
    case = make_case(seqs, h, kvh, head_dim, block_size, torch.float32, seed=h + head_dim)
    routed = [mod._in_span_kernel(p, case.q, case.k_cache, None) for p in case.meta.prefills]
    # 3 rows, or 5 over a context past SPAN_MAX_CONTEXT: the per-row kernel
    assert routed == [False, True, True, True, True, True, True, True, False]
    res = compare(cpu_backend, TorchAttentionBackend(), case)
    assert res["rel_err"] < 1e-5, res
    assert res["cache_equal"]


def test_span_kernel_threads_and_bad_block_table(cpu_backend):
    """One thread or two, a q that is a view with row stride past its heads: the same result; a block id
    outside the cache, or a span longer than its block table, is a RuntimeError naming it."""
    import dataclasses

    case = make_case([(60, 9)], 9, 3, 64, 16, torch.float32, seed=4)
    wide = torch.randn(case.q.shape[0], case.q.shape[1] + 2, case.q.shape[2])
    wide[:, 1:-1] = case.q
    strided = dataclasses.replace(case, q=wide[:, 1:-1])
    assert strided.q.stride(0) != strided.q.shape[1] * strided.q.shape[2]
    assert compare(cpu_backend, TorchAttentionBackend(), strided)["rel_err"] < 1e-5
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert compare(cpu_backend, TorchAttentionBackend(), case)["rel_err"] < 1e-5
    finally:
        torch.set_num_threads(n)
    p = case.meta.prefills[0]
    table = p.block_table.clone()
    table[1] = 10_000
    with pytest.raises(RuntimeError, match=r"block id 10000 outside \[0, "):
        torch.ops.kvfleet.paged_span_attention_cpu(torch.empty_like(case.q), case.q, case.k_cache, case.v_cache,
                                                   table, p.q_start, p.q_len, p.prefix_len, 1.0)
    with pytest.raises(RuntimeError, match=r"prefix_len \+ q_len = 1000 \+ 9 outside the 5 blocks"):
        torch.ops.kvfleet.paged_span_attention_cpu(torch.empty_like(case.q), case.q, case.k_cache, case.v_cache,
                                                   p.block_table, p.q_start, p.q_len, 1000, 1.0)


def test_kernel_uses_torch_threads(cpu_backend):
    """The same result with 1 thread and with all of torch's threads (the work split changes)."""
    case = make_case(SEQS["mixed"], 8, 2, 16, 8, torch.float32, seed=5)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compare(cpu_backend, TorchAttentionBackend(), case)
    finally:
        torch.set_num_threads(n)
    assert one["rel_err"] < 1e-5


def test_chunks_from_position_0_reach_the_span_kernel_within_its_context_cap():
    """A float32 chunk that starts at position 0 goes to the span kernel from SPAN_MIN_ROWS rows up to
    SPAN_MAX_CONTEXT (its panels' memory bound), to SDPA outside that range, and never for other dtypes."""
    from kvfleet_server.attention import cpu_backend as cb
    from kvfleet_server.attention.backend import PrefillSpan

    q, cache = torch.empty(1, 9, 64), torch.empty(1, 16, 3, 64)

    def taken(n, dtype=torch.float32):
        return cb._in_span_kernel(PrefillSpan(0, n, n, torch.zeros(1, dtype=torch.long)), q.to(dtype),
                                  cache.to(dtype), None)
    assert [taken(n) for n in (cb.SPAN_MIN_ROWS - 1, cb.SPAN_MIN_ROWS, 1100, cb.SPAN_MAX_CONTEXT,
                               cb.SPAN_MAX_CONTEXT + 1)] == [False, True, True, True, False]
    assert not taken(64, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_decode_bits_do_not_depend_on_the_work_split(cpu_backend, kv_dtype):
    """A decode batch with at least twice as many rows as threads gives each thread whole rows (every kv head of a
    row in one work item, its K/V rows read whole), a smaller one a row's kv heads apart: the same bits either way
    (here 6 rows at 1 thread: whole rows, at 4 threads: heads apart), and within 1e-5 of the oracle."""
    from kvfleet_server.attention.cpu_backend import paged_rows

    case = make_case([(37, 1), (16, 1), (5, 1), (70, 1), (3, 1), (50, 1)], 9, 3, 16, 8, torch.float32, seed=7)
    if kv_dtype != torch.float32:
        case.k_cache, case.v_cache = case.k_cache.to(kv_dtype), case.v_cache.to(kv_dtype)
    tables, rows, row_seq, row_len = paged_rows(case.meta)
    n, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            out = torch.empty_like(case.q)
            cpu_backend.op(out, case.q, case.k_cache, case.v_cache, tables, rows, row_seq, row_len, 0.125, 1.0, 1.0)
            outs.append(out)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(outs[0], outs[1])
    if kv_dtype == torch.float32:
        assert compare(cpu_backend, TorchAttentionBackend(), case)["rel_err"] < 1e-5


def test_auto_picks_the_cpu_kernel_and_refuses_it_elsewhere():
    assert resolve_attention_backend("auto", "cpu") == "cpu"
    assert resolve_attention_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU"):
        resolve_attention_backend("cpu", "cuda")


def test_unbuildable_kernel_falls_back_on_auto_and_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(cpu_ext, "_state", {"op": None, "error": "CalledProcessError: no g++"})
    assert resolve_attention_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match=r"attention_backend='cpu'.*could not be built \(CalledProcessError: no g\+\+\)"):
        resolve_attention_backend("cpu", "cpu")


def test_engine_greedy_tokens_cpu_kernel_equal_torch(tiny_llama_dir):
    """Whole engine runs on the tiny Llama (block size 8, a 16-token chunk budget): chunked prefill over
    cached blocks, decodes over several blocks, prefix-cache hits for the repeated prompt — the same
    greedy tokens with the C++ kernel as with the torch reference."""
    from kvfleet_server import LLM, SamplingParams

    prompts = [[3 + (i * 7 + j) % 50 for j in range(n)] for i, n in enumerate((5, 23, 40, 31))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory_bytes=2 << 20, block_size=8,
                  max_num_batched_tokens=16, attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [r.outputs[0].token_ids for r in llm.generate(prompts + prompts[:1], sp)]
    assert outs["cpu"] == outs["torch"]
    assert all(len(t) == 12 for t in outs["cpu"])


@pytest.mark.parametrize("field,value,match", [
    ("row_len", 10_000, r"row_len\[0\] = 10000 outside \[1, "),
    ("rows", 99, r"rows\[0\] = 99 outside \[0, "),
    ("block", 10_000, r"block id 10000 outside \[0, "),
])
def test_kernel_refuses_out_of_range_indices(cpu_backend, field, value, match):
    """A bad block table or row index is a RuntimeError naming it, never an out-of-bounds access."""
    from kvfleet_server.attention.cpu_backend import paged_rows

    case = make_case(SEQS["decode"], 8, 2, 16, 8, torch.float32, seed=1)
    tables, rows, row_seq, row_len = (t.clone() for t in paged_rows(case.meta))
    if field == "row_len":
        row_len[0] = value
    elif field == "rows":
        rows[0] = value
    else:
        tables[0, 0] = value
    out = torch.empty_like(case.q)
    with pytest.raises(RuntimeError, match=match):
        cpu_backend.op(out, case.q, case.k_cache, case.v_cache, tables, rows, row_seq, row_len, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_equals_index_copy_skips_pad_slots_and_refuses_a_bad_slot(cpu_backend, dtype):
    """reshape_and_cache_cpu writes what write_kv's index_copy_ writes, from K/V that are views into a fused
    qkv row (the model's layout), leaves pad slots (-1) unwritten, and refuses a slot past the pool by name
    before writing anything."""
    g = torch.Generator().manual_seed(0)
    T, kvh, hd, nb, bs = 7, 3, 64, 5, 16
    qkv = torch.randn(T, (9 + 2 * kvh) * hd, generator=g).to(dtype)
    k, v = (qkv[:, (9 + i * kvh) * hd:(9 + (i + 1) * kvh) * hd].view(T, kvh, hd) for i in range(2))
    slots = torch.tensor([3, 17, -1, 40, 79, -1, 6])  # no real row writes slot 0 or the last: a stray pad write shows
    caches = [torch.randn(nb, bs, kvh, hd, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    keep = slots >= 0
    for w, x in zip(want, (k, v)):
        w.view(-1, kvh, hd).index_copy_(0, slots[keep], x[keep])
    cpu_backend.write_op(k, v, caches[0], caches[1], slots)
    assert all(torch.equal(c, w) for c, w in zip(caches, want))
    before = [c.clone() for c in caches]
    with pytest.raises(RuntimeError, match=r"slot 80 outside \[0, 80\)"):
        cpu_backend.write_op(k, v, caches[0], caches[1], torch.tensor([1, 2, 3, 4, 5, 6, 80]))
    assert all(torch.equal(c, b) for c, b in zip(caches, before))


def test_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """A lock left by a build killed midway would make every later start wait forever."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    cpu_ext._clear_stale_lock(str(tmp_path))
    assert lock.exists()  # a build in progress
    old = time.time() - cpu_ext.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    cpu_ext._clear_stale_lock(str(tmp_path))
    assert not lock.exists()


def test_build_folder_names_the_isa_level_and_source_hash():
    name = cpu_ext._name(cpu_ext.isa_level())
    assert name.startswith("kvfleet_cpu_ops_") and cpu_ext.isa_level().replace("-", "_") in name
    assert cpu_ext.build_directory(name).endswith(os.path.join("kvfleet", name))
    names = {cpu_ext._name(level) for level in cpu_ext.X86_LEVELS}
    assert len(names) == len(cpu_ext.X86_LEVELS)  # each level its own folder (and flags in the hash)


@pytest.mark.parametrize("where", ["q", "k_cache"])
@pytest.mark.parametrize("ctx", [4, 15, 40])
def test_nan_propagates_like_the_torch_backend(cpu_backend, where, ctx):
    """A NaN in a query or in one cached key (an overflowed 16-bit activation) comes out NaN in the
    rows that see it, as in the torch backend, whatever the context length — never a finite average."""
    import dataclasses

    case = make_case([(ctx, 1), (ctx + 3, 1)], 9, 3, 64, 16, torch.float32, share=False, seed=2)
    if where == "q":
        q = case.q.clone()
        q[0, 0, 5] = float("nan")
        case = dataclasses.replace(case, q=q)
    else:
        kc = case.k_cache.clone()
        block = int(case.meta.decode_groups[0].block_tables[0, 0])
        kc[block, 1, 0, 3] = float("nan")  # token 1 of sequence 0, kv head 0
        case = dataclasses.replace(case, k_cache=kc)
    got = run_backend(cpu_backend, case)[0]
    ref = run_backend(TorchAttentionBackend(), case)[0]
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.isnan(got[0]).any()
    assert torch.allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
