"""Helpers shared by the engine tests (imported as a plain module: tests/server is on sys.path)."""

from __future__ import annotations


def run_to_completion(engine, max_steps: int = 100000, on_step=None, first_outputs=()) -> dict:
    """Step until idle; returns {request_id: final RequestOutput} and checks the outputs' deltas add up."""
    finals = {}
    texts: dict[tuple[str, int], str] = {}
    toks: dict[tuple[str, int], list[int]] = {}
    pending = list(first_outputs)
    for _ in range(max_steps):
        if not pending and not engine.has_unfinished():
            break
        outs, pending = pending or engine.step(), []
        for out in outs:
            for c in out.outputs:
                texts[(out.request_id, c.index)] = texts.get((out.request_id, c.index), "") + c.delta_text
                toks.setdefault((out.request_id, c.index), []).extend(c.delta_token_ids)
                assert texts[(out.request_id, c.index)] == c.text
                assert toks[(out.request_id, c.index)] == c.token_ids
            if out.finished:
                finals[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    else:
        raise AssertionError("engine did not become idle")
    return finals


def assert_pool_consistent(engine) -> None:
    """Every block is either referenced by exactly the live tables that hold it, or free."""
    pool = engine.kv.pool
    refs: dict[int, int] = {}
    for table in engine.kv.block_tables.values():
        for b in table:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id} ref_cnt {b.ref_cnt} != {refs.get(b.block_id, 0)}"
    assert pool.num_free_blocks == pool.num_blocks - len(refs)


def assert_all_blocks_free(engine) -> None:
    assert engine.kv.block_tables == {} or all(not t for t in engine.kv.block_tables.values())
    assert engine.num_free_blocks == engine.kv.num_blocks
    assert_pool_consistent(engine)
