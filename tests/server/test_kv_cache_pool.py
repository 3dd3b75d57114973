"""Block pool and block tables: reference counts, free queue order, copy-on-write, prefix hashes."""

from __future__ import annotations

import pytest

from kvfleet_server.engine.kv_cache import BlockPool, KVCacheManager, NoFreeBlocksError
from kvfleet_server.sequence import hash_block_tokens


def test_allocate_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 0, 10) == []  # 3 blocks
    assert kv.allocate_slots("b", 0, 4) == []  # 1 block
    assert kv.pool.num_free_blocks == 4
    assert kv.allocate_slots("a", 10, 2) == []  # fits in block 3 (slots 10, 11)
    assert len(kv.block_tables["a"]) == 3
    assert kv.allocate_slots("a", 12, 1) == []  # needs a 4th block
    assert len(kv.block_tables["a"]) == 4
    assert kv.allocate_slots("c", 0, 17) is None  # 5 blocks > 3 free: nothing changes
    assert "c" not in kv.block_tables or kv.block_tables["c"] == []
    assert kv.pool.num_free_blocks == 3
    kv.free("a")
    kv.free("b")
    kv.free("c")
    assert kv.pool.num_free_blocks == 8
    with pytest.raises(NoFreeBlocksError):
        p = BlockPool(1)
        p.allocate()
        p.allocate()


def test_fork_shares_and_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("p", 0, 6)  # blocks: full + partial (2 of 4 slots)
    kv.fork("p", "c")
    assert [b.ref_cnt for b in kv.block_tables["p"]] == [2, 2]
    assert kv.pool.num_free_blocks == 6
    copies = kv.allocate_slots("c", 6, 1)  # child writes slot 6 in the shared partial block
    old, new = kv.block_tables["p"][1].block_id, kv.block_tables["c"][1].block_id
    assert copies == [(old, new)] and old != new
    assert kv.block_tables["c"][0] is kv.block_tables["p"][0]  # the full block stays shared
    assert kv.allocate_slots("p", 6, 1) == []  # parent now owns its partial block alone: no copy
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_cached_blocks_are_lru_and_evicted_last():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.publish(a, b"ha")
    pool.publish(b, b"hb")
    pool.decref(a)
    pool.decref(b)
    pool.decref(c)
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    assert pool.allocate() is c  # uncached first
    assert pool.lookup(b"hb") is b
    pool.incref(b)  # a hit revives b
    pool.decref(b)  # b is now the most recently used cached block
    assert pool.allocate() is a  # LRU evicted: a
    assert pool.lookup(b"ha") is None and pool.lookup(b"hb") is b


def test_hash_chain_and_extra_keys():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2], ("salt", "a")) != hash_block_tokens(None, [1, 2], ("salt", "b"))
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))
    assert len(h1) == 32
