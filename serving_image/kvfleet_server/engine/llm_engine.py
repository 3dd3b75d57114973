"""LLMEngine: the step-level engine (add_request / abort_request / step / has_unfinished).

Data flow of one ``step()``: schedule (``Scheduler.schedule()`` picks the sequences and token counts) →
feature hooks (``SpecDecoder.before_forward`` runs the copy-on-write copies the drafters must see and fills
reserved draft slots) → execute (the runner performs the remaining copies, builds the flat batch and runs the
model over the paged KV cache) → sample (``SpecDecoder.verify`` for drafted rows, then logits of the other
rows that sample, grammar bitmask, ``sample()``) → process (``OutputProcessor.append`` as each token is
accepted or sampled: detokenized, stop conditions checked, finished sequences release their blocks at once;
then RequestOutputs, cumulative + delta).

Not thread-safe: drive it from one thread (the HTTP server runs it in a dedicated thread).
Aborted requests: ``abort_request`` frees the blocks immediately and the next ``step()`` returns one
final RequestOutput with finish_reason "abort" for each aborted request.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..attention.kv_quant import kv_cache_torch_dtype
from ..config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from .detokenizer import IncrementalDetokenizer
from ..errors import InvalidRequestError, PromptTooLongError
from .kv_cache import KVCacheManager
from ..distributed import TPGroup
from ..executor.engine_setup import build_shard, prepare_model, size_kv_pool
from ..executor.workers import WorkerGroup, start_workers
from ..model.layers.quant import model_weight_bytes, quantization_note
from ..generation_config import read_generation_defaults
from ..model.checkpoint import is_gguf
from ..model.gguf_reader import GGUFModelFile, open_gguf
from ..model.loader import load_model_config
from ..model.sharding import check_tp_size
from ..outputs import RequestOutput
from ..executor.model_runner import kv_bytes_per_token
from ..sample.grammar import GrammarCompiler, SequenceGrammar, grammar_bitmask
from ..sample.sampler import SampleRow, prompt_logprobs, sample
from ..sampling_params import SamplingParams
from .output_processor import OutputProcessor
from .lora import LoRAManager
from ..model.lora_checkpoint import LoRAError
from .scheduler import Scheduler
from ..sequence import LoRARequest, Request, ScheduledSeq, Sequence, SeqStatus
from ..stats import IterationStats, SchedulerStats
from ..model.tokenizer import Tokenizer
from ..spec_decode.decoder import SpecDecoder
from ..spec_decode_config import SpeculativeConfig

logger = logging.getLogger("kvfleet.engine")



def _timed(fn, *args, **kwargs):
    """(fn(*args, **kwargs), seconds it took)."""
    t = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t


class LLMEngine:
    """Continuous-batching engine over one model.

    Attributes:
        config: the EngineConfig.
        tokenizer: kvfleet ``Tokenizer``.
        max_model_len: longest prompt + output (tokens).
        model_name: served model name.
        num_blocks / block_size: KV pool geometry.
        last_iteration: IterationStats of the latest step.
    """

    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        timings: dict[str, float] = {}
        t = time.monotonic()

        def lap(phase: str) -> None:
            nonlocal t
            now = time.monotonic()
            timings[phase] = timings.get(phase, 0.0) + now - t
            t = now

        path = config.resolved_model()
        self.quantization = config.resolved_quantization()
        gguf = None
        if is_gguf(path):  # read once, for the config, the tokenizer and the weights
            gguf = GGUFModelFile(path, packed=self.quantization == "gguf")
            lap("gguf cache read" if gguf.from_cache else "gguf parse")
        tp_size = config.tensor_parallel_size
        self.tp = TPGroup(0, tp_size, torch.device("cuda:0" if self.device == "cuda" else self.device))
        self.workers: WorkerGroup | None = None
        try:
            mcfg = load_model_config(path, gguf)
            if tp_size > 1:
                check_tp_size(mcfg, tp_size)  # refuse before spawning anything
                self.workers = start_workers(config, self.device)
                lap("tensor-parallel spawn")
            # the tokenizer loads in a thread while the weights are copied (mostly outside the GIL)
            arch = gguf.architecture if gguf is not None and config.tokenizer in (None, path) else None
            pool = ThreadPoolExecutor(1, thread_name_prefix="kvfleet-tokenizer")
            tokenizer = pool.submit(_timed, Tokenizer.from_path, config.tokenizer or path, mcfg.eos_token_ids,
                                    gguf_architecture=arch)
            pool.shutdown(wait=False)
            self.model, self.model_config, max_len = build_shard(config, self.tp, gguf, timings=lap)
            #: bytes of the weights as stored by this rank (packed/quantized formats included; rope excluded)
            self.weight_bytes = model_weight_bytes(self.model)
            logger.info("weights: %s, %.1f MiB%s, activations %s%s", self.quantization or "unquantized",
                        self.weight_bytes / 2**20, f" (rank 0 of {tp_size})" if tp_size > 1 else "", self.dtype,
                        quantization_note(self.quantization, self.device))
            lap("weights")
            self.tokenizer, timings["tokenizer (in a thread)"] = tokenizer.result()
            lap("tokenizer wait")
            # after the tokenizer thread: it imports transformers, which is not safe to import concurrently
            #: defaults of the sampling fields a request leaves unset (--generation-config; the server applies
            #: them, as vLLM's serving layer does: api/convert.py, LLM.get_default_sampling_params)
            reader = None  # a warm start (GGUF cache hit) has no parsed file: parse it with the fast reader
            if gguf is not None and config.generation_config == "auto":
                reader = gguf.reader if gguf.reader is not None else open_gguf(path)
            self.generation_defaults = read_generation_defaults(config.generation_config, path, reader)
            logger.info("request defaults: %s", self.generation_defaults.describe())
            if gguf is not None:
                gguf.close()  # drop the file mapping: the weights are copied into the model
            # the draft model loads while the workers load their shards, before the process groups form
            # (their collectives time out: distributed.py)
            #: --speculative-config (None without it); the server exports the spec_decode metrics for it
            self.spec_config = (SpeculativeConfig.from_dict(config.speculative_config)
                                if config.speculative_config else None)
            #: speculative decoding (None without it, or when no acceptance rate pays for it here)
            self.spec: SpecDecoder | None = None
            if self.spec_config is not None:
                self.spec = SpecDecoder.create(self.spec_config, self.model, self.model_config, self.dtype,
                                               self.device, max_len)
                lap("draft model")
            if self.workers is not None:
                self.workers.wait_loaded()
                lap("tensor-parallel workers loaded")
                self.workers.join(self.tp)
                lap("tensor-parallel connect")
            self.model_name = config.resolved_served_name()
            self.block_size = bs = config.block_size
            self.max_num_batched_tokens = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
            self.runner, self.num_blocks = size_kv_pool(
                config, self.model, self.tp, self.device,
                extra_kv_bytes_per_token=self.spec.extra_kv_bytes_per_token if self.spec else 0)
            if self.spec is not None:
                self.spec.bind(self.runner)
            lap("kv_cache allocation")
            prepare_model(config, self.model, self.tp)
            lap("compile")
        except BaseException:
            self.shutdown()
            raise
        mc = self.model_config
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        per_token = kv_bytes_per_token(mc.num_hidden_layers, self.model.shard.num_kv_heads, mc.head_dim,
                                       self.kv_cache_dtype)
        if self.spec is not None:
            per_token += self.spec.extra_kv_bytes_per_token
        capacity = self.num_blocks * bs
        if max_len > capacity:
            if config.max_model_len is not None:
                self.shutdown()
                raise ValueError(
                    f"max_model_len={max_len} does not fit in the KV pool ({self.num_blocks} blocks × {bs} = "
                    f"{capacity} tokens); raise kv_cache_memory_bytes or lower max_model_len"
                )
            max_len = capacity
        self.max_model_len = max_len
        logger.info(
            "KV cache: %d blocks × %d tokens (%.1f MiB%s, %s); max_model_len=%d; max concurrency at max_model_len: "
            "%.2fx", self.num_blocks, bs, self.num_blocks * bs * per_token / 2**20,
            f" per rank × {tp_size} ranks" if tp_size > 1 else "", self.kv_cache_dtype, max_len, capacity / max_len,
        )
        self.kv = KVCacheManager(self.num_blocks, bs)
        #: LoRA adapters: the registry and the model's adapter slots (off: max_loras 0)
        self.lora = LoRAManager(config.max_loras if config.enable_lora else 0, self.runner)
        for module in config.lora_modules or []:
            try:
                self.lora.add(module["name"], module["path"], module.get("base_model_name"))
            except LoRAError as exc:
                self.shutdown()
                raise LoRAError(f"--lora-modules {module['name']}={module['path']}: {exc}", exc.param,
                                exc.status) from None
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_prefix_caching, lora=self.lora)
        self.output = OutputProcessor(self.tokenizer, self.scheduler, config)
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._rng = torch.Generator().manual_seed(config.seed)
        self.last_iteration = IterationStats()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._kv_events_sink = None
        lap("other")
        #: seconds spent per start-up phase (gguf parse or gguf cache read, config, weights, tokenizer
        #: wait, kv_cache allocation, compile, other), in order, and "tokenizer (in a thread)": the
        #: tokenizer's own load time, overlapped with the weights; the server logs them.
        self.startup_timings: dict[str, float] = timings

    @classmethod
    def from_engine_args(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    # --- tensor-parallel workers ---------------------------------------------------------------
    def watch_workers(self, on_death) -> None:
        """Call ``on_death(rank, pid, exit_code)`` from a daemon thread if a tensor-parallel worker dies
        (no-op without tensor parallelism). The engine cannot step after that."""
        if self.workers is not None:
            self.workers.watch(on_death)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process groups (idempotent; no-op for N = 1)."""
        workers, self.workers = getattr(self, "workers", None), None
        if workers is not None:
            workers.stop()
        tp = getattr(self, "tp", None)
        if tp is not None:
            tp.destroy()

    # --- introspection -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv.pool.num_free_blocks

    def get_stats(self) -> SchedulerStats:
        pool = self.kv.pool
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        return SchedulerStats(
            num_running=len(running), num_waiting=len(waiting), kv_cache_usage=pool.usage,
            num_blocks_total=pool.num_blocks, num_blocks_free=pool.num_free_blocks,
            num_blocks_cached=pool.num_cached_blocks, **self.lora.stats(self.scheduler),
        )

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler (built on first use; thread-safe: the server compiles off the
        engine thread through ``grammar_compiler.submit``)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                so = self.config.resolved_structured_outputs()
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer.hf, self.model_config.vocab_size, sorted(self.tokenizer.eos_token_ids),
                    any_whitespace=not so["disable_any_whitespace"], max_whitespace=so["max_whitespace"])
            return self._grammar_compiler

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    add_special_tokens: bool = True, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; ``lora_request`` (``add_lora``'s result, or ``get_lora(name)``)
        runs it with that adapter.

        Raises:
            InvalidRequestError: duplicate id, empty prompt, token ids outside the vocabulary, bad params, n above
                max_num_seqs (its sequences are admitted together).
            PromptTooLongError: prompt + max_tokens > max_model_len, or a prompt the pool can never hold.
        """
        params = params if params is not None else SamplingParams()
        if lora_request is not None and self.lora.get(lora_request.name) != lora_request:
            raise InvalidRequestError(f"LoRA adapter {lora_request.name!r} is not loaded", param="model")
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        params.validate()
        if params.n > self.config.max_num_seqs:  # its n sequences are admitted together: it could never start
            raise InvalidRequestError(f"n must be at most {self.config.max_num_seqs} (max_num_seqs), got {params.n}",
                                      param="n")
        limit = self.config.max_logprobs if self.config.max_logprobs >= 0 else self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > limit:
                raise InvalidRequestError(f"{name} must be in [0, {limit}] (max_logprobs), got {getattr(params, name)}",
                                          param=name)
        if params.structured_outputs is not None and params.structured_outputs.compiled is None:
            self.grammar_compiler.compile(params.structured_outputs)  # blocking; the server compiles beforehand
        if isinstance(prompt, str):
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text = None
            ids = [int(t) for t in prompt]
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", param="prompt")
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        bs = self.block_size
        if -(-(n + 1) // bs) > self.num_blocks:
            raise PromptTooLongError(
                f"prompt has {n} tokens and needs {-(-(n + 1) // bs)} KV blocks of {bs} tokens, but the KV pool "
                f"holds only {self.num_blocks} blocks ({self.num_blocks * bs} tokens)", param="prompt",
            )
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens, max_model_len is {self.max_model_len}: no room for an output token",
                param="prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len={self.max_model_len}", param="max_tokens",
            )
        now = time.monotonic()
        req = Request(request_id, text, ids, params, arrival_time if arrival_time is not None else now,
                      max_tokens, cache_salt, lora_request)
        leader = self._new_sequence(req, 0, ids)
        self.requests[request_id] = req
        self.scheduler.add(leader)

    def _new_sequence(self, req: Request, index: int, token_ids: list[int], parent: Sequence | None = None) -> Sequence:
        """Sequence ``index`` of ``req``: its generator (seeded per sample), grammar (the leader's own, or a
        fork of ``parent``'s matcher state) and detokenizer."""
        p = req.params
        gen = None
        if not p.greedy:
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
            seed = (seed + index * 0x9E3779B97F4A7C15) % 2**63
            gen = torch.Generator(device=self.device).manual_seed(seed)
        seq = Sequence(req, index, token_ids, gen)
        if parent is not None and parent.grammar is not None:
            seq.grammar = parent.grammar.fork()
        elif p.structured_outputs is not None and index == 0:
            stop_ids = sorted(self.tokenizer.eos_token_ids | set(p.stop_token_ids))
            seq.grammar = SequenceGrammar(p.structured_outputs.compiled, stop_ids)
        seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens)
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their blocks; unknown ids are ignored. The next step() returns
        a final RequestOutput with finish_reason "abort" for each."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            req.aborted = True
            req.forked = True
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.remove(seq)
                    seq.status = SeqStatus.FINISHED
                    seq.finish_reason = "abort"
            req.metrics.finished_time = time.monotonic()
            self._pending.append(self.output.make_output(req))

    # --- LoRA adapters -------------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Load the PEFT adapter at ``path`` under ``name`` (engine thread). Raises LoRAError (HTTP 400 /
        404: LoRA off, name taken, a bad or missing adapter)."""
        return self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter ``name``: requests already queued finish with it. Raises LoRAError (404)."""
        self.lora.remove(name)

    def get_lora(self, name: str) -> LoRARequest | None:
        return self.lora.get(name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora.adapters.values())

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching; returns outputs of requests that got new tokens or finished.
        The step's KV events (if a sink is set, ``set_kv_events_sink``) go to the sink once it is done."""
        with torch.inference_mode():
            outputs = self._step()
        self._flush_kv_events()
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``; ``BlockPool.reset_prefix_cache``); the
        AllBlocksCleared event goes to the KV-events sink at once. Engine thread only."""
        self.kv.pool.reset_prefix_cache()
        self._flush_kv_events()

    def _flush_kv_events(self) -> None:
        if self._kv_events_sink is not None:
            events = self.kv.pool.take_events()
            if events:
                self._kv_events_sink(events)

    def set_kv_events_sink(self, sink) -> None:
        """Hand each step's KV-cache events (``engine.kv_cache.KVEvent`` list, oldest first) to ``sink`` on
        the engine thread, after the step; None stops recording. The sink must not block: the server's is
        ``kv_events.ZmqEventPublisher.publish`` (a bounded queue). Without prefix caching nothing is
        published to the cache, so there are no events."""
        self._kv_events_sink = sink
        self.kv.pool.record_events = sink is not None
        self.kv.pool.take_events()

    def _step(self) -> list[RequestOutput]:
        """schedule → feature hooks → execute → sample → process (docs/engine.md, "The step")."""
        sched = self.scheduler.schedule()
        it = IterationStats(num_preemptions=len(sched.preempted), prefix_cache_queries=sched.prefix_cache_queries,
                            prefix_cache_hits=sched.prefix_cache_hits)
        outputs, self._pending = self._pending, []
        if not sched.scheduled:
            self.last_iteration = it
            return outputs
        scheduled, copies, drafts = sched.scheduled, sched.copies, {}
        self._count_scheduled(scheduled, it)
        self.lora.before_forward()  # hook: adapters newly given a slot are loaded into it
        if self.spec is not None:  # hook: reserve draft slots, fill them with drafts
            drafts, copies = self.spec.before_forward(sched, self.scheduler, self.kv, self.runner)
        batch = self.runner.execute([s.span(self.kv.block_ids(s.seq.seq_id), self.lora.slot(s.seq))
                                     for s in scheduled], copies)
        for block in sched.pinned:  # partial prefix hits' sources, pinned until their copies ran
            self.kv.pool.decref(block)
        samplers = [i for i, s in enumerate(scheduled) if s.samples and not s.draft_ids]  # drafted rows: verify
        self._prompt_logprobs(scheduled, batch)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_known  # drafts count once verified (SpecDecoder.verify)
            self.scheduler.publish_computed_blocks(s.seq)
        touched: dict[str, Request] = {}
        seqs, rows = self._sampling_rows(scheduled, samplers, batch, touched)
        if drafts:  # hook: verify the drafts against the target's rows
            for seq in self.spec.verify(scheduled, batch, drafts, self.runner, self.scheduler, self._sample_row,
                                        self.output.append, it):
                touched[seq.request.request_id] = seq.request
        if rows:
            self._sample(batch, seqs, rows, it, touched)
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = time.monotonic()
                self.requests.pop(req.request_id, None)
            outputs.append(self.output.make_output(req))
        self.last_iteration = it
        return outputs

    def _count_scheduled(self, scheduled: list[ScheduledSeq], it: IterationStats) -> None:
        """First-scheduled times, and the prompt tokens this step computes (``it.num_prompt_tokens``)."""
        now = time.monotonic()
        for s in scheduled:
            m = s.seq.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
            it.num_prompt_tokens += max(0, min(s.seq.num_computed_tokens + s.num_new, s.seq.num_prompt_tokens)
                                        - s.seq.num_computed_tokens)

    def _sampling_rows(self, scheduled: list[ScheduledSeq], samplers: list[int], batch, touched: dict[str, Request]
                       ) -> tuple[list[Sequence], list[int]]:
        """(sequences that sample a token this step, their logits rows) for the ``samplers`` (indices in
        ``scheduled``). A prompt of n > 1 samples is forked here, once computed (the samples share its
        blocks); a request with max_tokens 0 (prompt scoring) finishes without sampling."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for i in samplers:
            seq = scheduled[i].seq
            req = seq.request
            if req.max_tokens == 0:
                self._finish_without_sampling(req, seq)
                touched[req.request_id] = req
                continue
            rows.append(batch.last_row[i])
            seqs.append(seq)
            if not req.forked:
                req.forked = True
                for k in range(1, req.params.n):
                    child = self._new_sequence(req, k, seq.token_ids, parent=seq)
                    child.num_computed_tokens = seq.num_computed_tokens
                    self.kv.fork(seq.seq_id, child.seq_id)
                    self.scheduler.add_running(child)
                    rows.append(batch.last_row[i])
                    seqs.append(child)
        return seqs, rows

    def _sample(self, batch, seqs: list[Sequence], rows: list[int], it: IterationStats,
                touched: dict[str, Request]) -> None:
        """Sample one token for each of ``seqs`` from its logits row (grammar bitmask applied) and append it."""
        logits = self.runner.compute_logits(batch, rows)
        t_mask = time.perf_counter()
        bitmask = grammar_bitmask([s.grammar for s in seqs], self.model_config.vocab_size)
        it.structured_output_mask_s = time.perf_counter() - t_mask
        tokens, lps = sample(logits, [self._sample_row(s) for s in seqs], bitmask)
        now = time.monotonic()
        for seq, tok, lp in zip(seqs, tokens, lps):
            jumped = self.output.append(seq, tok, lp)
            it.num_generation_tokens += 1 + jumped
            it.num_jump_forward_tokens += jumped
            req = seq.request
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            touched[req.request_id] = req

    # --- helpers -------------------------------------------------------------------------------
    def _finish_without_sampling(self, req: Request, seq: Sequence) -> None:
        """max_tokens 0: every one of the n completions ends empty with finish_reason "length"."""
        req.forked = True
        for k in range(1, req.params.n):
            self._new_sequence(req, k, list(seq.token_ids))
        for s in req.seqs:
            if not s.is_finished:
                self.output.finish(s, "length")

    def _sample_row(self, seq: Sequence, drafts: list[int] = ()) -> SampleRow:
        """Sampling context of the seq's next token; ``drafts`` = the draft tokens before the position
        (speculative verification: history and min_tokens count them as if accepted)."""
        p = seq.request.params
        stop_ids: list[int] = []
        if p.min_tokens and seq.num_output_tokens + len(drafts) < p.min_tokens:
            stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tokenizer.eos_token_ids)))
        needs_hist = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        return SampleRow(
            params=p,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens] if needs_hist else [],
            output_ids=seq.output_token_ids + list(drafts) if (needs_hist or stop_ids) else [],
            generator=seq.generator,
            stop_ids_for_min_tokens=stop_ids,
        )

    def _prompt_logprobs(self, scheduled: list[ScheduledSeq], batch) -> None:
        for i, s in enumerate(scheduled):
            req = s.seq.request
            pl = req.prompt_logprobs
            if pl is None or s.seq.index != 0 or len(pl) >= len(req.prompt_token_ids):
                continue
            start, n = batch.chunk_rows[i]
            p0 = s.seq.num_computed_tokens
            first = max(p0, len(pl) - 1)
            last = min(p0 + n, len(req.prompt_token_ids) - 1)  # positions whose next token is in the prompt
            if last <= first:
                continue
            logits = self.runner.compute_logits(batch, list(range(start + first - p0, start + last - p0)))
            nxt = req.prompt_token_ids[first + 1 : last + 1]
            for tok, lp in zip(nxt, prompt_logprobs(logits, nxt, req.params.prompt_logprobs)):
                pl.append(self.output.logprob_entry(tok, lp))
