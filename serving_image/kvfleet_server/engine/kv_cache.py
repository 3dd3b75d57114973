"""Paged KV cache bookkeeping: the block pool (reference counts, free queue, prefix-hash map) and
per-sequence block tables. The tensors themselves live in ``executor/model_runner.py`` (``ModelRunner.kv_caches``).

Memory layout (see attention/backend.py): per layer K and V ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A sequence's token ``t`` lives in ``block_table[t // block_size]`` at offset
``t % block_size``.

Design after vLLM's v1 KV cache manager:
- Blocks carry ``ref_cnt`` (sharing between the n samples of a request, and between requests hitting
  the same cached prefix) and an optional ``block_hash`` (content hash of a full block, chained over
  its prefix — ``sequence.hash_block_tokens``).
- Free blocks sit in two queues: never-hashed blocks (taken first) and hashed "cached" blocks in LRU
  order (oldest evicted first when no uncached block is left). A cached free block can be revived
  by a prefix hit. Blocks with ref_cnt > 0 are never evicted.
- Writing into a shared block (ref_cnt > 1) first copies it to a fresh block (copy-on-write); the copy
  is returned to the runner, which performs it before the forward pass.
- KV events (vLLM's ``--kv-events-config``): with ``record_events`` on, the pool records what it does to
  the prefix cache — blocks published (``BlocksStored``, one per run of consecutive blocks of a sequence,
  with the prefix cache's own hashes), cached blocks evicted (``BlocksRemoved``) and the whole cache
  reset (``CacheCleared``) — for ``take_events`` to hand to a publisher after each step. Recording is
  a list append on the engine thread; publishing happens elsewhere (``kv_events.py``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from ..errors import KVFleetError


class NoFreeBlocksError(KVFleetError, RuntimeError):
    """The pool has no free block left (the scheduler preempts instead of letting this escape)."""


@dataclass
class KVBlock:
    """One block of ``block_size`` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # set while published: the key of its parent (parent hash, extra keys) and its token ids, so that a
    # prompt whose next block only partly matches can reuse the matching leading slots
    parent_key: tuple | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class BlocksStored:
    """Full blocks newly published to the prefix cache: consecutive blocks of one sequence.

    ``parent_block_hash`` is the hash of the block before the first (None at the start of a sequence);
    ``token_ids`` are the blocks' tokens, block after block (``len(block_hashes) * block_size`` of them)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlocksRemoved:
    """Cached blocks whose hash left the prefix cache (evicted to make room)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class CacheCleared:
    """Every hash left the prefix cache (``reset_prefix_cache``)."""


KVEvent = BlocksStored | BlocksRemoved | CacheCleared


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks with reference counts and an LRU prefix cache."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._hash_to_block: dict[bytes, int] = {}
        self._children: dict[tuple, set[int]] = {}  # (parent hash, extra keys) -> published block ids
        self.num_evictions = 0
        #: record KV events for ``take_events`` (off: nothing is kept)
        self.record_events = False
        self._events: list[KVEvent] = []

    # --- introspection -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any live sequence (cached-but-free blocks included)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable, hashed prefix."""
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # --- allocation ----------------------------------------------------------------------------
    def allocate(self) -> KVBlock:
        """Take a free block (uncached first, else evict the least recently used cached one)."""
        if self._free_uncached:
            block = self.blocks[self._free_uncached.popleft()]
        elif self._free_cached:
            bid, _ = self._free_cached.popitem(last=False)
            block = self.blocks[bid]
            if self.record_events:
                self._events.append(BlocksRemoved((block.block_hash,)))
            self._drop_hash(block)
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError("no free KV block")
        assert block.ref_cnt == 0
        block.ref_cnt = 1
        return block

    def incref(self, block: KVBlock) -> None:
        """Take one more reference (revives a cached free block)."""
        if block.ref_cnt == 0:
            del self._free_cached[block.block_id]
        block.ref_cnt += 1

    def decref(self, block: KVBlock) -> None:
        """Drop one reference; at zero the block returns to the free queue (cached ones at the MRU end)."""
        assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is not None:
                self._free_cached[block.block_id] = None
            else:
                self._free_uncached.append(block.block_id)

    # --- prefix cache --------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> KVBlock | None:
        bid = self._hash_to_block.get(block_hash)
        return None if bid is None else self.blocks[bid]

    def publish(self, block: KVBlock, block_hash: bytes, parent_key: tuple | None = None,
                token_ids: tuple[int, ...] = ()) -> bool:
        """Mark a full, computed block as reusable under ``block_hash`` (first writer wins).
        ``parent_key`` = (parent hash or None, extra keys) and ``token_ids`` index it for partial matches.
        Returns whether the block was newly published (False: it already was, or another block holds the hash)."""
        if block.block_hash is not None or block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block.block_id
        if parent_key is not None:
            block.parent_key, block.token_ids = parent_key, tuple(token_ids)
            self._children.setdefault(parent_key, set()).add(block.block_id)
        return True

    def record_stored(self, event: BlocksStored) -> None:
        """Record a run of newly published blocks (``KVCacheManager.publish_full_blocks``, while
        ``record_events`` is on)."""
        self._events.append(event)

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (and forget them)."""
        events, self._events = self._events, []
        return events

    def best_partial_match(self, parent_key: tuple, tokens: list[int]) -> tuple[KVBlock | None, int]:
        """Published block under ``parent_key`` sharing the longest leading run with ``tokens``.
        Returns (block, number of matching leading tokens) or (None, 0)."""
        best, best_n = None, 0
        for bid in self._children.get(parent_key, ()):
            b = self.blocks[bid]
            n = 0
            for x, y in zip(b.token_ids, tokens):
                if x != y:
                    break
                n += 1
            if n > best_n:
                best, best_n = b, n
        return best, best_n

    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._hash_to_block.get(block.block_hash) == block.block_id:
                del self._hash_to_block[block.block_hash]
            block.block_hash = None
            if block.parent_key is not None:
                kids = self._children.get(block.parent_key)
                if kids is not None:
                    kids.discard(block.block_id)
                    if not kids:
                        del self._children[block.parent_key]
                block.parent_key, block.token_ids = None, ()

    def reset_prefix_cache(self) -> None:
        """Forget every hash (vLLM's reset_prefix_cache): cached free blocks become plain free blocks, blocks in
        use keep their contents for their sequences but are no longer shared with new ones. Records
        ``CacheCleared``."""
        for bid in list(self._hash_to_block.values()):
            self._drop_hash(self.blocks[bid])
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()
        if self.record_events:
            self._events.append(CacheCleared())


class KVCacheManager:
    """Per-sequence block tables over a ``BlockPool``.

    ``allocate_slots`` makes room for a sequence's next tokens (allocating on demand and doing
    copy-on-write of a shared block about to be written); ``free`` returns a sequence's blocks;
    ``fork`` shares a block table with a new sequence (n > 1 sampling).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq_id, [])]

    def allocate_slots(self, seq_id: str, num_computed: int, num_new: int) -> list[tuple[int, int]] | None:
        """Ensure slots for positions [num_computed, num_computed + num_new) are owned by ``seq_id``.

        Returns the copy-on-write pairs (src_block_id, dst_block_id) to perform before the forward
        pass, or None (and changes nothing) when the pool cannot supply the blocks.
        """
        table = self.block_tables.setdefault(seq_id, [])
        bs = self.block_size
        need_total = self.blocks_for(num_computed + num_new)
        new_blocks = max(0, need_total - len(table))
        first = num_computed // bs
        # shared blocks, and blocks published to the prefix cache, are never written in place
        cow_idx = [i for i in range(first, min(len(table), need_total))
                   if table[i].ref_cnt > 1 or table[i].block_hash is not None]
        if new_blocks + len(cow_idx) > self.pool.num_free_blocks:
            return None
        copies = []
        for i in cow_idx:
            old = table[i]
            new = self.pool.allocate()
            copies.append((old.block_id, new.block_id))
            self.pool.decref(old)
            table[i] = new
        for _ in range(new_blocks):
            table.append(self.pool.allocate())
        return copies

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def free(self, seq_id: str) -> None:
        """Release all of a sequence's blocks (tail first, so a cached prefix's head lives longest)."""
        for block in reversed(self.block_tables.pop(seq_id, [])):
            self.pool.decref(block)

    def truncate(self, seq_id: str, num_blocks: int) -> None:
        """Keep the first ``num_blocks`` blocks of a sequence's table, release the rest (tail first)."""
        table = self.block_tables.get(seq_id)
        while table is not None and len(table) > num_blocks:
            self.pool.decref(table.pop())

    def fork(self, parent_id: str, child_id: str) -> None:
        """Child shares every block of the parent (ref counts +1); writes later trigger copy-on-write."""
        table = self.block_tables[parent_id]
        for b in table:
            self.pool.incref(b)
        self.block_tables[child_id] = list(table)

    # --- prefix caching hooks ------------------------------------------------------------------
    def attach_cached_blocks(self, seq_id: str, blocks: list[KVBlock]) -> None:
        """Start a sequence's table with prefix-cache hits (takes a reference on each)."""
        assert not self.block_tables.get(seq_id)
        for b in blocks:
            self.pool.incref(b)
        self.block_tables[seq_id] = list(blocks)

    def publish_full_blocks(self, seq_id: str, hashes: list[bytes], start: int, token_ids: list[int] | None = None,
                            extra: tuple = ()) -> None:
        """Publish blocks [start, len(hashes)) of the sequence under their chained hashes (with their
        tokens, for partial-block matching, when ``token_ids`` is given)."""
        table = self.block_tables.get(seq_id, [])
        bs = self.block_size
        new: list[int] = []
        for i in range(start, min(len(hashes), len(table))):
            if token_ids is None:
                published = self.pool.publish(table[i], hashes[i])
            else:
                parent = hashes[i - 1] if i else None
                published = self.pool.publish(table[i], hashes[i], (parent, extra),
                                              tuple(token_ids[i * bs : (i + 1) * bs]))
            if published:
                new.append(i)
        if self.pool.record_events:
            for first, last in _runs(new):  # one BlocksStored per run of consecutive blocks
                self.pool.record_stored(BlocksStored(
                    tuple(hashes[first : last + 1]), hashes[first - 1] if first else None,
                    tuple(token_ids[first * bs : (last + 1) * bs]) if token_ids is not None else ()))


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive integers in the ascending ``indices``."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs
