"""ModelRunner: owns the KV cache tensors, turns a step's token spans into flat batch tensors + attention
metadata, runs the model and returns hidden states / logits.

KV cache tensors: for each layer a triple (K, V, kv_scales): K and V each ``[num_blocks, block_size,
num_kv_heads, head_dim]`` in the KV-cache dtype (the model dtype, or float8 for ``--kv-cache-dtype
fp8*``), zero-initialised (padding reads of unused slots are masked out but must not be NaN; on the
CPU the pool is one anonymous memory map, whose pages the kernel zeroes when they are first touched:
start-up does not write the whole pool, ``zeroed_cpu_tensors``);
kv_scales None, or for FP8 the layer's float32 [2] (k_scale, v_scale) (see attention/kv_quant.py).
With tensor parallelism ``num_kv_heads`` is this rank's: every rank holds its shard of every block,
under the same block ids, so rank 0's block tables address all of them.

A step is ``prepare`` (rank 0 only: ``TokenSpan`` list → ``StepInputs``, plain lists) then ``run`` (every
rank: tensors → model). Tensor parallelism is hidden behind ``call`` (nano-vllm's ``call``): rank 0
broadcasts the method's name and arguments to the other ranks (``workers.py`` hands each message to
``serve``), then runs it itself; without tensor parallelism ``call`` is a plain method call. The methods
every rank runs are ``COLLECTIVE``: ``run`` (a step, or a layer_skip draft pass), ``copy_blocks``
(copy-on-write the drafters need before the step), ``row_logits`` (logits of rows that were not computed
with the step), ``probe`` (the all-reduce benchmark), and for LoRA ``cache_lora`` (every rank reads a newly
loaded adapter into its host-memory LRU) and ``load_lora`` (an adapter into a slot: each rank its own shard).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..attention import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSpan
from ..attention.kv_quant import HEADROOM, hadamard, is_fp8
from ..distributed import TPGroup
from ..model.layers.lora import LoRAMapping, attach_lora, set_adapter
from ..model.lora_checkpoint import AdapterCache
from ..sequence import LoRARequest, TokenSpan

logger = logging.getLogger("kvfleet.engine")

# Decode grouping: sequences sorted by context length are split when padding would waste more than
# this fraction of a group's gathered K/V (and the group already has a few members).
# Groups are also capped in size: a group's gathered K/V then stays cache-resident between the gather
# and the attention that reads it (measured ~3x faster decode attention on CPU than one group of 64).
_MAX_PAD_WASTE = 0.2
_MIN_GROUP = 4
_MAX_GROUP = 16

#: the runner methods every rank runs when rank 0 ``call``s them (the tensor-parallel message vocabulary)
COLLECTIVE = frozenset({"run", "copy_blocks", "row_logits", "probe", "cache_lora", "load_lora"})


def zeroed_cpu_tensors(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """``count`` zero CPU tensors of ``shape`` / ``dtype`` carved out of one anonymous memory map.

    The kernel hands out zero pages on first touch, so nothing is written here: a 1 GiB KV pool costs
    no start-up time (``torch.zeros`` writes every page, ~0.4-0.8 s on a 2-core machine) and only the
    pages of blocks in use become resident. Each tensor keeps the map alive. No transparent huge pages
    are requested: a first touch would then zero (and make resident) 2 MiB for a 12 KiB block. The
    memory is committed lazily, so a pool larger than a container's memory limit fails under load,
    not at start-up: size ``kv_cache_memory_bytes`` within the limit.
    """
    import mmap

    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    stride = -(-nbytes // 64) * 64  # each tensor 64-byte aligned, like torch's CPU allocator
    buf = mmap.mmap(-1, max(stride * count, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return [flat[i * stride:i * stride + nbytes].view(dtype).view(shape) for i in range(count)]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K + V for one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class StepBatch:
    """Flat-batch layout of one step.

    Attributes:
        hidden: [T, hidden] final hidden states.
        last_row: index into ``scheduled`` → row of that sequence's last computed token.
        chunk_rows: index into ``scheduled`` → (first row, number of rows) of its tokens.
        logits / logits_at: logits computed with the step ([len(logits_at), vocab]) and row → index.
    """

    hidden: torch.Tensor
    last_row: list[int]
    chunk_rows: list[tuple[int, int]]
    logits: torch.Tensor | None = None
    logits_at: dict[int, int] = field(default_factory=dict)


@dataclass
class StepInputs:
    """One step's flat batch as plain Python values: what rank 0 broadcasts to the other ranks.

    Attributes:
        input_ids: [T] token ids, the D decode tokens first, then the prefill chunks.
        dec_positions / dec_slots: [D] position and flat KV slot of each decode token.
        decode_groups: (start, count, block tables [count][max_blocks], context lengths [count]).
        prefills: (q_start, q_len, ctx_len, block table [ceil(ctx_len / block_size)]) per chunk.
        copies: copy-on-write block copies (src, dst) to apply before the step.
        logit_rows: rows whose logits are computed with the step: the last row of each span that samples
            and every row of a span that verifies drafts (under tensor parallelism a decode step then
            needs no second broadcast).
        num_layers: run only the first L decoder layers (the layer_skip drafter's pass); None: all.
        lora_slots: [T] each row's LoRA adapter slot (−1: the base model).
    """

    input_ids: list[int]
    dec_positions: list[int]
    dec_slots: list[int]
    decode_groups: list[tuple[int, int, list[list[int]], list[int]]]
    prefills: list[tuple[int, int, int, list[int]]]
    copies: list[tuple[int, int]] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    num_layers: int | None = None
    lora_slots: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: str,
                 dtype: torch.dtype, backend: AttentionBackend, kv_cache_dtype: torch.dtype | None = None):
        cfg = model.config
        self.model = model
        self.tp: TPGroup = getattr(model, "tp", None) or TPGroup()
        self.last_hidden: torch.Tensor | None = None
        self.step_logits: torch.Tensor | None = None
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = backend
        #: decode CUDA graphs (executor/cuda_graphs.py), set up by engine_setup after the pool exists
        self.graphs = None
        #: rows → LoRA slots of the current pass (stays empty without --enable-lora: ``enable_lora``)
        self.lora_mapping = LoRAMapping(self.device)
        #: adapters in host memory (--max-cpu-loras; None without --enable-lora)
        self.adapters: AdapterCache | None = None
        shape = (num_blocks, block_size, model.shard.num_kv_heads, cfg.head_dim)
        ckpt_scales = getattr(model, "kv_cache_scales", {}) or {}
        self._kv_calibration_pending = is_fp8(kv_dtype) and len(ckpt_scales) < cfg.num_hidden_layers

        def scales(i: int) -> torch.Tensor | None:
            if not is_fp8(kv_dtype):
                return None
            return torch.tensor(ckpt_scales.get(i, (0.0, 0.0)), dtype=torch.float32, device=self.device)

        n = 2 * cfg.num_hidden_layers
        if self.device.type == "cpu":
            kv = zeroed_cpu_tensors(n, shape, kv_dtype)
        else:
            kv = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in range(n)]
        self.kv_caches = [(kv[2 * i], kv[2 * i + 1], scales(i)) for i in range(cfg.num_hidden_layers)]
        if is_fp8(kv_dtype) and ckpt_scales:
            logger.info("KV cache %s: k/v scales of %d layers from the checkpoint", kv_dtype, len(ckpt_scales))
        if self._kv_calibration_pending:
            logger.info("KV cache %s: k/v scales of %d layers calibrated from the first prefill's absmax x%.0f "
                        "headroom (each layer's values at DEBUG)", kv_dtype,
                        cfg.num_hidden_layers - len(ckpt_scales), HEADROOM)
        # an FP8 cache with the engine's own scales stores K and V in a Hadamard basis (kv_quant.py)
        rotation = hadamard(cfg.head_dim, torch.float32, self.device) if is_fp8(kv_dtype) else None
        rotated = [i for i in range(cfg.num_hidden_layers) if i not in ckpt_scales]
        model.set_kv_rotation(rotation, rotated)
        if rotation is not None and rotated:
            logger.info("KV cache %s: q, k, v rotated by a %dx%d Hadamard matrix in %d layers before the cache "
                        "rounds them (QuaRot)", kv_dtype, cfg.head_dim, cfg.head_dim, len(rotated))
        elif is_fp8(kv_dtype) and rotated:
            logger.info("KV cache %s: head_dim %d is not a power of 2: K and V are not rotated", kv_dtype,
                        cfg.head_dim)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst := block src in every layer's K and V."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k, v, _ in self.kv_caches:  # as bytes: index kernels do not take float8
            k, v = k.view(torch.uint8), v.view(torch.uint8)
            k[dst] = k[src]
            v[dst] = v[src]

    def _decode_groups(self, ctx_lens: list[int]) -> list[tuple[int, int]]:
        """Split sorted decode rows into (start, count) groups of similar context length."""
        bs = self.block_size
        groups, start, total = [], 0, 0
        for i, c in enumerate(ctx_lens):
            nb = -(-c // bs)
            count = i - start + 1
            if count > _MAX_GROUP or (count > _MIN_GROUP and (count * nb - (total + nb)) > _MAX_PAD_WASTE * count * nb):
                groups.append((start, i - start))
                start, total = i, 0
            total += nb
        if ctx_lens:
            groups.append((start, len(ctx_lens) - start))
        return groups

    def prepare(self, spans: list[TokenSpan], copies: list[tuple[int, int]] = (), num_layers: int | None = None
                ) -> tuple[StepInputs, list[int], list[tuple[int, int]]]:
        """Lay out one step's token spans (pure Python: 1-token spans — decodes — first, sorted by
        context length, then the longer spans: prefill chunks and decodes with draft tokens).

        The rows of each span's ``logits`` are computed with the step. Returns (inputs, last_row,
        chunk_rows) indexed like ``spans``.
        """
        bs = self.block_size
        dec = sorted((i for i, s in enumerate(spans) if len(s.token_ids) == 1), key=lambda i: spans[i].start)
        pre = [i for i, s in enumerate(spans) if len(s.token_ids) > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last_row = [0] * len(spans)
        chunk_rows = [(0, 0)] * len(spans)
        ctx_lens = []
        for row, i in enumerate(dec):
            sp = spans[i]
            p, bt = sp.start, sp.block_table
            ids.append(sp.token_ids[0])
            pos.append(p)
            slots.append(bt[p // bs] * bs + p % bs)
            ctx_lens.append(p + 1)
            last_row[i] = row
            chunk_rows[i] = (row, 1)
        groups = []
        for start, count in self._decode_groups(ctx_lens):
            mb = -(-ctx_lens[start + count - 1] // bs)
            tables = []
            for i in dec[start : start + count]:
                bt = list(spans[i].block_table[:mb])
                tables.append(bt + [bt[0]] * (mb - len(bt)))
            groups.append((start, count, tables, ctx_lens[start : start + count]))
        prefills = []
        q_start = len(ids)
        for i in pre:
            sp = spans[i]
            n, ctx = len(sp.token_ids), sp.start + len(sp.token_ids)
            ids.extend(sp.token_ids)
            prefills.append((q_start, n, ctx, list(sp.block_table[: -(-ctx // bs)])))
            last_row[i] = q_start + n - 1
            chunk_rows[i] = (q_start, n)
            q_start += n
        logit_rows = []
        for i, sp in enumerate(spans):
            if sp.logits is not None:
                first, n = chunk_rows[i] if sp.logits == "all" else (last_row[i], 1)
                logit_rows.extend(range(first, first + n))
        lora_slots: list[int] = []
        if any(sp.lora_slot >= 0 for sp in spans):  # else empty: every row is the base model's
            lora_slots = [spans[i].lora_slot for i in dec]
            for i in pre:
                lora_slots += [spans[i].lora_slot] * len(spans[i].token_ids)
        inputs = StepInputs(ids, pos, slots, groups, prefills, list(copies), logit_rows, num_layers, lora_slots)
        return inputs, last_row, chunk_rows

    def call(self, method: str, *args):
        """Run ``method(*args)`` on every rank (``COLLECTIVE``): rank 0 broadcasts the call to the other
        ranks, then runs it; returns rank 0's result. Without tensor parallelism: a plain call."""
        if self.tp.is_parallel:
            self.tp.broadcast_object((method, args))
        return getattr(self, method)(*args)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Apply the step's copy-on-write copies, build the tensors and run the model (every rank).

        Returns hidden states [T, hidden] (kept in ``self.last_hidden``); also computes the logits of
        ``inputs.logit_rows`` (kept in ``self.step_logits`` on rank 0; None when the list is empty).
        """
        self.copy_blocks(inputs.copies)
        self.lora_mapping.set(inputs.lora_slots)
        if self.graphs is not None and self.graphs.can_run(inputs):  # decode-only: replay a CUDA graph
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(*self._tensors(inputs), self.kv_caches, self._metadata(inputs), self.backend,
                                num_layers=inputs.num_layers)
        self.last_hidden = hidden
        self.step_logits = None
        if inputs.logit_rows:
            self.step_logits = self.model.compute_logits(hidden[torch.tensor(inputs.logit_rows, device=self.device)])
        return hidden

    def _tensors(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, positions): [T] int64 each, decode rows first."""
        dev = self.device
        pre_pos = [torch.arange(ctx - n, ctx, device=dev) for _, n, ctx, _ in inputs.prefills]
        input_ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=dev)
        positions = torch.cat([torch.tensor(inputs.dec_positions, dtype=torch.long, device=dev)] + pre_pos)
        return input_ids, positions

    def _metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """The step's attention metadata: slot mapping [T], decode groups (block tables, masks, context
        lengths) and prefill spans (block table, causal mask over the cached prefix)."""
        bs, dev = self.block_size, self.device
        groups = []
        for start, count, tables, ctx_lens in inputs.decode_groups:
            mb = len(tables[0])
            ctx = torch.tensor(ctx_lens, device=dev)
            mask = (torch.arange(mb * bs, device=dev)[None, :] < ctx[:, None])[:, None, None, :]
            groups.append(DecodeGroup(start, count, torch.tensor(tables, device=dev), mask, ctx))
        prefills, pre_slots = [], []
        for q_start, n, ctx, table in inputs.prefills:
            p0 = ctx - n
            bt = torch.tensor(table, device=dev)
            ppos = torch.arange(p0, ctx, device=dev)
            pre_slots.append(bt[ppos // bs] * bs + ppos % bs)
            mask = None
            if p0 > 0:
                mask = torch.arange(ctx, device=dev)[None, :] <= ppos[:, None]
            prefills.append(PrefillSpan(q_start, n, ctx, bt, mask))
        slot_mapping = torch.cat([torch.tensor(inputs.dec_slots, dtype=torch.long, device=dev)] + pre_slots)
        # an FP8 pool without checkpoint scales calibrates them in the first pass: a full-depth prefill of
        # the target (drafts need a decoding sequence), which reaches every layer
        calibrate, self._kv_calibration_pending = self._kv_calibration_pending, False
        return AttentionMetadata(slot_mapping=slot_mapping, num_decodes=len(inputs.dec_positions),
                                 decode_groups=groups, prefills=prefills, kv_calibrate=calibrate)

    @torch.inference_mode()
    def execute(self, spans: list[TokenSpan], copies: list[tuple[int, int]] = (),
                num_layers: int | None = None) -> StepBatch:
        """Run the model on one step's ``spans`` on every rank (K/V written to the cache as a side effect),
        after the copy-on-write ``copies`` (src, dst). ``num_layers`` runs only the first L layers (+ final
        norm), reading and writing only those layers' KV: the layer_skip drafter's pass. A draft model's
        runner has no tensor-parallel group: its passes run on rank 0 alone."""
        inputs, last_row, chunk_rows = self.prepare(spans, copies, num_layers)
        hidden = self.call("run", inputs)
        logits_at = {r: k for k, r in enumerate(inputs.logit_rows)}
        return StepBatch(hidden, last_row, chunk_rows, self.step_logits, logits_at)

    def copy_blocks_on_every_rank(self, copies: list[tuple[int, int]]) -> None:
        """Rank 0: apply copy-on-write ``copies`` now on every rank (before a drafter reads the KV; a step
        carries its own copies otherwise)."""
        if copies:
            self.call("copy_blocks", list(copies))

    @torch.inference_mode()
    def compute_logits(self, batch: StepBatch, rows: list[int] | None = None) -> torch.Tensor:
        """Logits of rows ``rows`` (default: all) of ``batch.hidden``: [len(rows), vocab] float32.

        Rows computed with the step (``TokenSpan.logits``) are looked up; others (prompt logprobs, a draft
        pass's rows) are computed now, on every rank under tensor parallelism (``row_logits``)."""
        rows = list(range(batch.hidden.shape[0])) if rows is None else rows
        if batch.logits is not None and all(r in batch.logits_at for r in rows):
            idx = [batch.logits_at[r] for r in rows]
            if idx == list(range(batch.logits.shape[0])):
                return batch.logits
            return batch.logits[torch.tensor(idx, device=batch.logits.device)]
        if batch.hidden is not self.last_hidden:  # the other ranks only keep the last pass's hidden states
            raise RuntimeError("compute_logits: rows of an earlier pass than the runner's last one")
        return self.call("row_logits", list(rows))

    def row_logits(self, rows: list[int]) -> torch.Tensor | None:
        """Logits of rows ``rows`` of the last pass's hidden states (every rank; None off rank 0)."""
        return self.model.compute_logits(self.last_hidden[torch.tensor(rows, dtype=torch.long, device=self.device)])

    def enable_lora(self, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        """Give the model's projections ``max_loras`` adapter slots of rank ``max_rank`` and keep up to
        ``max_cpu_loras`` adapters in host memory (every rank, at start-up)."""
        self.lora_mapping = attach_lora(self.model, max_loras, max_rank, self.dtype, self.device)
        self.adapters = AdapterCache(max_cpu_loras, self.model.config, max_rank)

    def load_lora(self, slot: int, lora: LoRARequest) -> None:
        """Slot ``slot`` := adapter ``lora`` (from the host-memory LRU, or read from its path). Collective.
        Raises LoRAError (``model/lora_checkpoint.py``)."""
        set_adapter(self.model, slot, self.adapters.get(lora))

    def cache_lora(self, lora: LoRARequest) -> None:
        """Read adapter ``lora`` into this rank's host-memory LRU (at load time, on every rank). Collective."""
        self.adapters.get(lora)

    def probe_all_reduce(self, rows: int, iters: int = 20) -> float:
        """Seconds per all-reduce of a [rows, hidden] activation when every rank is idle (no waiting on a
        slower rank's compute): the transfer cost alone, for the benchmark. Collective."""
        return self.call("probe", rows, iters)

    def probe(self, rows: int, iters: int) -> float:
        x = torch.zeros(rows, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        self.tp.all_reduce(x)  # warm-up, and every rank arrives before the clock starts
        t = time.perf_counter()
        for _ in range(iters):
            self.tp.all_reduce(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t) / iters

    @torch.inference_mode()
    def serve(self, msg: tuple) -> bool:
        """Worker ranks: carry out one ``call`` of rank 0, ``(method, args)`` with method in ``COLLECTIVE``;
        returns False for ``("stop", ...)``. Raises ValueError for any other method."""
        method, args = msg[0], msg[1] if len(msg) > 1 else ()
        if method == "stop":
            return False
        if method not in COLLECTIVE:
            raise ValueError(f"unknown tensor-parallel message {method!r}")
        getattr(self, method)(*args)
        return True
