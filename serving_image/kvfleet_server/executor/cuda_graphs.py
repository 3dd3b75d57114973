"""CUDA graphs for decode-only steps (vLLM's piecewise-free "full" decode graphs, as in vLLM v0 and
SGLang's CudaGraphRunner): one graph per batch size of a fixed list, captured after the KV pool is
allocated, replayed with the step's inputs copied into static buffers.

A step with ``n`` decodes (and no prefill) runs the graph of the smallest captured size ``B >= n``;
rows ``n..B-1`` are padding: slot ``PAD_SLOT_ID`` (their K/V are written nowhere), context length 1
over block 0 (a harmless read), token 0 at position 0; their outputs are dropped. Larger batches,
steps with prefill chunks, and the first step of an uncalibrated FP8 cache run eagerly.

Memory: all graphs share one memory pool (captured largest first, so smaller graphs reuse the
largest one's activations); ``graph_memory_bytes`` gives what engine_setup reserves before the KV
pool is sized (the measured activation peak of one decode at the largest size, plus the static
buffers).
"""

from __future__ import annotations

import logging

import torch

from ..attention import PAD_SLOT_ID, AttentionMetadata, DecodeGroup

logger = logging.getLogger("kvfleet.engine")

#: vLLM's default ceiling for captured decode batch sizes
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, max_capture: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture (vLLM's list): 1, 2, 4, then multiples of 8, up to
    min(max_num_seqs, max_capture), which is always included."""
    cap = max(1, min(max_num_seqs, max_capture))
    sizes = [s for s in [1, 2, 4, *range(8, cap + 1, 8)] if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (sizes ascending), or None when n is larger than all (eager)."""
    for s in sizes:
        if s >= n:
            return s
    return None


def static_buffer_bytes(max_batch: int, max_blocks_per_seq: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of the static buffers: input ids, positions, slots, context lengths ([B] int64 each),
    block tables ([B, max_blocks_per_seq] int64) and the hidden-state output ([B, hidden] ``dtype``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 8 * max_batch * (4 + max_blocks_per_seq) + max_batch * hidden_size * itemsize


def graph_memory_bytes(decode_activation_peak: int, max_batch: int, max_blocks_per_seq: int, hidden_size: int,
                       dtype: torch.dtype) -> int:
    """Memory the graphs keep for good: the shared pool (the activation peak of one decode step at the
    largest captured size, measured by the profile run) plus the static buffers."""
    return decode_activation_peak + static_buffer_bytes(max_batch, max_blocks_per_seq, hidden_size, dtype)


class DecodeGraphs:
    """Static buffers and per-size launchers of a ModelRunner's decode graphs.

    Args:
        runner: the ModelRunner (its KV pool already allocated).
        sizes: ascending batch sizes (``capture_sizes``).
        max_blocks_per_seq: block-table width of the static buffers (ceil(max_model_len / block_size)).

    ``launch[B]`` runs the step for size B over the static buffers: ``capture()`` makes it a graph
    replay (CUDA); ``use_eager()`` makes it the same forward without a graph (the CPU tests, which
    check the bookkeeping).
    """

    def __init__(self, runner, sizes: list[int], max_blocks_per_seq: int):
        self.runner = runner
        self.sizes = list(sizes)
        self.max_blocks = max_blocks_per_seq
        B, dev = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((B,), PAD_SLOT_ID, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(B, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(B, max_blocks_per_seq, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(B, runner.model.config.hidden_size, dtype=runner.dtype, device=dev)
        self.launch: dict[int, callable] = {}
        self.pool = None

    def can_run(self, inputs) -> bool:
        """A decode-only step over all layers (not a layer_skip drafter's pass) of at most the largest
        size, after FP8 KV calibration (the step's logits are computed after the replay, outside the graph)."""
        n = len(inputs.dec_positions)
        return (0 < n <= self.sizes[-1] and not inputs.prefills and not self.runner._kv_calibration_pending
                and getattr(inputs, "num_layers", None) is None
                and bool(self.launch)
                and all(len(g[2][0]) <= self.max_blocks for g in inputs.decode_groups))

    def forward(self, B: int) -> None:
        """The model over rows [0, B) of the static buffers; hidden states into ``self.hidden[:B]``."""
        r = self.runner
        bs = r.block_size
        ctx = self.context_lens[:B]
        mask = (torch.arange(self.max_blocks * bs, device=r.device)[None, :] < ctx[:, None])[:, None, None, :]
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:B], num_decodes=B,
                                 decode_groups=[DecodeGroup(0, B, self.block_tables[:B], mask, ctx)],
                                 has_pad_slots=True)
        h = r.model(self.input_ids[:B], self.positions[:B], r.kv_caches, meta, r.backend)
        self.hidden[:B].copy_(h)

    def fill(self, inputs) -> int:
        """Copy a step's decodes into the static buffers and pad to the captured size; returns it."""
        n = len(inputs.dec_positions)
        B = padded_batch_size(n, self.sizes)
        tables = torch.zeros(B, self.max_blocks, dtype=torch.long)
        ctx = torch.ones(B, dtype=torch.long)
        for start, count, group_tables, lens in inputs.decode_groups:
            t = torch.tensor(group_tables, dtype=torch.long)
            tables[start:start + count, : t.shape[1]] = t
            ctx[start:start + count] = torch.tensor(lens, dtype=torch.long)
        pad = B - n
        ids = torch.tensor(list(inputs.input_ids) + [0] * pad, dtype=torch.long)
        pos = torch.tensor(list(inputs.dec_positions) + [0] * pad, dtype=torch.long)
        slots = torch.tensor(list(inputs.dec_slots) + [PAD_SLOT_ID] * pad, dtype=torch.long)
        for buf, src in ((self.input_ids, ids), (self.positions, pos), (self.slot_mapping, slots),
                         (self.context_lens, ctx), (self.block_tables, tables)):
            buf[:B].copy_(src, non_blocking=True)
        return B

    def run(self, inputs) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step (``can_run``): a copy, since the next replay
        overwrites the static output."""
        B = self.fill(inputs)
        self.launch[B]()
        return self.hidden[: len(inputs.dec_positions)].clone()

    def use_eager(self) -> None:
        """Every size runs ``forward`` directly: the graph's work without the graph."""
        self.launch = {B: (lambda B=B: self.forward(B)) for B in self.sizes}

    def capture(self) -> None:
        """Capture one graph per size on CUDA, largest first, sharing one memory pool."""
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        free_before = torch.cuda.mem_get_info(dev)[0]
        stream = torch.cuda.Stream(dev)
        with torch.inference_mode():
            for B in reversed(self.sizes):
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    self.forward(B)  # warm-up: compiles the Triton kernels, allocator caches
                torch.cuda.current_stream(dev).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.forward(B)
                self.pool = graph.pool()
                self.launch[B] = graph.replay
        torch.cuda.synchronize(dev)
        logger.info("CUDA graphs: captured decode batch sizes %s (%d graphs, %.1f MiB)", self.sizes,
                    len(self.sizes), (free_before - torch.cuda.mem_get_info(dev)[0]) / 2**20)
