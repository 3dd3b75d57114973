"""Start-up steps every rank runs the same way: load this rank's model shard, then agree on the KV pool.

KV pool sizing (vLLM's rule for tensor parallelism): each rank measures its own budget — on CUDA
``gpu_memory_utilization`` × total − memory in use after loading − the activation peak of a forward
pass over ``max_num_batched_tokens`` tokens (a profile run, collective across the ranks); on the CPU the
configured ``kv_cache_memory_bytes`` (per rank, default 1 GiB) — and the pool gets the number of blocks
the *smallest* budget holds, so every rank can hold its shard of every block.

With CUDA graphs (``enforce_eager`` off, a backend that supports them, one rank) the profile also runs
one decode step at the largest captured batch size, and the graphs' memory
(``cuda_graphs.graph_memory_bytes``) is taken from the budget before the pool is sized; the graphs are
captured once the pool exists.
"""

from __future__ import annotations

import logging

import torch

from ..attention import get_attention_backend
from .cuda_graphs import DecodeGraphs, capture_sizes, graph_memory_bytes
from ..attention.kv_quant import kv_cache_torch_dtype
from ..config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_MAX_NUM_BATCHED_TOKENS, MAX_DEFAULT_MODEL_LEN, EngineConfig
from ..model.config import ModelConfig
from ..model.checkpoint import is_gguf
from ..model.gguf_reader import GGUFModelFile
from ..model.loader import load_model, load_model_config
from ..model.sharding import check_tp_size
from ..distributed import TPGroup
from .model_runner import ModelRunner, StepInputs, kv_bytes_per_token

logger = logging.getLogger("kvfleet.engine")


def resolve_max_len(config: EngineConfig, mcfg: ModelConfig) -> int:
    """max_model_len before the KV pool caps it; ValueError when it exceeds the model's positions."""
    model_max = mcfg.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={model_max}"
        )
    return config.max_model_len or min(model_max, MAX_DEFAULT_MODEL_LEN)


def build_shard(config: EngineConfig, tp: TPGroup, gguf: GGUFModelFile | None = None, timings=None):
    """Load rank ``tp.rank``'s shard of the model (``gguf``: the GGUF file already read, else read here).

    Returns (model, ModelConfig, max_len). Raises UnsupportedFeatureError when the head counts cannot
    split over ``tp.world_size`` (before any weight is read), ModelLoadError / ValueError otherwise.
    """
    path = config.resolved_model()
    if gguf is None and is_gguf(path):
        # every rank reads the file; only rank 0 writes the GGUF cache (one entry, not N concurrent writes)
        gguf = GGUFModelFile(path, packed=config.resolved_quantization() == "gguf", save=tp.rank == 0)
    mcfg = load_model_config(path, gguf)
    check_tp_size(mcfg, tp.world_size)
    max_len = resolve_max_len(config, mcfg)
    if timings is not None:
        timings("config")
    device = str(tp.device) if tp.is_parallel else config.resolved_device()
    model, mcfg = load_model(path, config.resolved_dtype(), device, max_positions=max_len, gguf=gguf,
                             quantization=config.resolved_quantization(), tp=tp)
    return model, mcfg, max_len


def kv_budget_bytes(total: int, free: int, utilization: float, activation_peak: int, graph_bytes: int = 0) -> int:
    """KV bytes on one GPU (vLLM's rule): utilization × total, less what is in use after loading the
    weights (total - free: weights, CUDA context, other processes), less the profile run's activation
    peak and the CUDA graphs' memory. May be <= 0 (nothing left)."""
    return int(total * utilization) - (total - free) - activation_peak - graph_bytes


def graphs_wanted(config: EngineConfig, device: torch.device, backend, tp: TPGroup) -> bool:
    """CUDA graphs for decode steps: on CUDA, not --enforce-eager, a backend whose forward can be
    captured (the Triton one), one rank (the all-reduce of tensor parallelism is not captured)."""
    if device.type != "cuda" or config.enforce_eager:
        return False
    if not backend.supports_cuda_graphs or tp.is_parallel or config.enable_lora:
        logger.info("CUDA graphs off: %s", "tensor parallelism" if tp.is_parallel else
                    "LoRA (each step groups rows by adapter in Python)" if config.enable_lora else
                    f"the {backend.name} attention backend cannot be captured")
        return False
    return True


def max_blocks_per_seq(model, block_size: int) -> int:
    """Block-table width of the longest sequence (the model's rope table covers max_model_len)."""
    return -(-model.rope_cos.shape[0] // block_size)


def cuda_kv_budget(config: EngineConfig, model, block_size: int, device: torch.device, dtype: torch.dtype,
                   kv_dtype: torch.dtype, graph_batch: int = 0) -> int:
    """This rank's KV budget on CUDA (see the module docstring); every rank must call it together
    (the profile forward all-reduces). ``graph_batch``: the largest CUDA-graph batch size (0: none).
    Raises ValueError when nothing is left for the KV cache."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    T = min(config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, model.config.max_position_embeddings)
    T = max(T, min(config.max_num_seqs, model.config.max_position_embeddings))
    nb = -(-T // block_size) + 1
    backend = get_attention_backend(device.type, config.attention_backend)
    tmp = ModelRunner(model, nb, block_size, str(device), dtype, backend, kv_dtype)
    # the largest step: T prefill tokens, with the logits of up to max_num_seqs sampled rows
    tmp.run(StepInputs(input_ids=[0] * T, dec_positions=[], dec_slots=[], decode_groups=[],
                       prefills=[(0, T, T, list(range(-(-T // block_size))))],
                       logit_rows=list(range(min(config.max_num_seqs, T)))))
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - base
    graph_bytes = 0
    if graph_batch:
        torch.cuda.reset_peak_memory_stats(device)
        base2 = torch.cuda.memory_allocated(device)
        tmp.run(StepInputs(input_ids=[0] * graph_batch, dec_positions=[0] * graph_batch, dec_slots=[0] * graph_batch,
                           decode_groups=[(0, graph_batch, [[0]] * graph_batch, [1] * graph_batch)], prefills=[]))
        torch.cuda.synchronize(device)
        graph_bytes = graph_memory_bytes(torch.cuda.max_memory_allocated(device) - base2, graph_batch,
                                         max_blocks_per_seq(model, block_size), model.config.hidden_size, dtype)
    del tmp
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, free, config.gpu_memory_utilization, activation, graph_bytes)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no memory for the KV cache on {device} "
            f"(total {total} B, in use {total - free} B, activation peak {activation} B, CUDA graphs {graph_bytes} B)"
        )
    logger.info("CUDA profile (%s): activation peak %.1f MiB, CUDA graphs %.1f MiB, KV budget %.1f MiB", device,
                activation / 2**20, graph_bytes / 2**20, budget / 2**20)
    return budget


def num_blocks_for(budgets: list[int], bytes_per_block: int) -> tuple[int, int]:
    """(blocks every rank can hold, rank with the smallest budget) for per-rank ``budgets`` in bytes."""
    smallest = min(range(len(budgets)), key=lambda r: budgets[r])
    return budgets[smallest] // bytes_per_block, smallest


def size_kv_pool(config: EngineConfig, model, tp: TPGroup, device: str | None = None,
                 extra_kv_bytes_per_token: int = 0) -> tuple[ModelRunner, int]:
    """Agree on the pool size over the ranks and allocate this rank's KV shard.

    ``extra_kv_bytes_per_token``: KV bytes per token kept elsewhere under the same block ids (a
    speculative draft model's own cache), so that the budget holds both. Returns (ModelRunner, num_blocks). Raises ValueError on every rank when one block does not fit.
    """
    mc, bs = model.config, config.block_size
    dtype = config.resolved_dtype()
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
    device = device or (str(tp.device) if tp.is_parallel else config.resolved_device())
    per_token = kv_bytes_per_token(mc.num_hidden_layers, model.shard.num_kv_heads, mc.head_dim, kv_dtype)
    per_token += extra_kv_bytes_per_token
    dev = torch.device(device)
    backend = get_attention_backend(dev.type, config.attention_backend)
    sizes = capture_sizes(config.max_num_seqs) if graphs_wanted(config, dev, backend, tp) else []
    if dev.type == "cuda" and config.kv_cache_memory_bytes is None:
        budget = cuda_kv_budget(config, model, bs, dev, dtype, kv_dtype, sizes[-1] if sizes else 0)
    else:
        budget = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    budgets = tp.gather_object(budget)
    num_blocks = None
    if tp.rank == 0:
        num_blocks, smallest = num_blocks_for(budgets, per_token * bs)
        if tp.is_parallel:
            logger.info("KV budgets per rank (MiB): %s; rank %d is the smallest: %d blocks",
                        [round(b / 2**20, 1) for b in budgets], smallest, num_blocks)
    num_blocks = tp.broadcast_object(num_blocks)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={min(budgets) if budgets else budget} is too small: one KV block of {bs} tokens "
            f"needs {per_token * bs} bytes"
        )
    runner = ModelRunner(model, num_blocks, bs, device, dtype, backend, kv_dtype)
    if config.enable_lora:
        runner.enable_lora(config.max_loras, config.max_lora_rank, config.resolved_max_cpu_loras())
    if sizes:  # after the pool is allocated: the graphs address its tensors
        runner.graphs = DecodeGraphs(runner, sizes, min(max_blocks_per_seq(model, bs), num_blocks))
        runner.graphs.capture()
    return runner, num_blocks


def prepare_model(config: EngineConfig, model, tp: TPGroup) -> None:
    """After loading, the model's kernels for the configuration. At compilation level 3
    (``EngineConfig.resolved_compilation_level``: the default on CUDA, ``-O3`` elsewhere): torch.compile
    the decoder layers piecewise and warm them up (``model/compile.py``). At level 0 on the CPU: with
    ``cpu_fused_ops``, the layers' element-wise work in kvfleet's fused C++ kernels
    (``model/layers/layer_ops.py``; torch's ops when the kernels cannot be built); with
    ``cpu_weight_prepack``, the float32 linears' weights packed once for kvfleet's AVX2 kernel (oneDNN's
    without the C++ library; ``model/layers/cpu_prepack.py``).
    Collective under tensor parallelism: every rank calls it after loading."""
    dev = tp.device if tp.is_parallel else torch.device(config.resolved_device())
    if config.resolved_compilation_level() == 0:
        if dev.type == "cpu" and config.cpu_fused_ops:
            from ..model.layers.layer_ops import cpu_layer_ops, use_layer_ops

            ops = cpu_layer_ops()
            if ops is not None:
                use_layer_ops(model, ops)
                logger.info("fused CPU layer ops: RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul "
                            "(--no-cpu-fused-ops keeps torch's)")
        if dev.type == "cpu" and config.cpu_weight_prepack:
            from ..model.layers.cpu_prepack import PanelLinearMethod, packed_method, prepack_linears

            method = packed_method()
            if method is not None:
                count, extra = prepack_linears(model, method)
                kind = "kvfleet's 16-column panels" if method is PanelLinearMethod else "oneDNN's layout"
                logger.info("float32 linears prepacked in %s: %d%s (--no-cpu-weight-prepack keeps F.linear)", kind, count,
                            f", and a packed copy of the tied LM head (+{extra / 2**20:.0f} MiB)" if extra else "")
        return
    from ..model.compile import compile_cache_dir, compile_layers, warm_up

    compile_layers(model)
    seconds = warm_up(model, config.resolved_dtype(), dev)
    logger.info("torch.compile of the decoder layers: %.1fs (cache %s; --enforce-eager skips it)", seconds,
                compile_cache_dir())
