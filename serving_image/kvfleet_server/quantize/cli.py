"""``kvfleet-quantize``: a float checkpoint → an FP8 checkpoint (compressed-tensors FP8_DYNAMIC) rounded
with GPTQ on calibration text, served by ``kvfleet-server --model OUT`` (the fp8 method is found from
config.json; ``--quantization fp8`` may be passed too) and loadable by vLLM.

    kvfleet-quantize --output ./smollm2-fp8                     # the bundled model, GPTQ on stdlib docstrings
    kvfleet-quantize --model ./my-llama --output ./my-llama-fp8 --calibration-file notes.txt
    kvfleet-quantize --output ./smollm2-fp8-rtn --rounding rtn   # round to nearest (what --quantization fp8 does at load)

Exit status 2 with the flag named for bad input (a checkpoint already quantized, an --output that is the
source or already holds weights, a calibration text too short). A .gguf source must be a plain-rope Llama
without biases (``evaluate.export_float_checkpoint``), as the bundled model is.

Memory: the float32 model, every projection's float64 H (K × K each: about 0.8 GB for SmolLM2-135M, tens of
GB for a 7B model) and the checkpoint are held at once; it is built for small models on a CPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

logger = logging.getLogger("kvfleet.quantize")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet-quantize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="float checkpoint: HF directory or .gguf file (default: the "
                   "bundled SmolLM2-135M-Instruct, dequantized to float32)")
    p.add_argument("--output", required=True, help="directory to write the FP8 checkpoint to")
    p.add_argument("--scheme", default="FP8_DYNAMIC", choices=["FP8_DYNAMIC"],
                   help="llm-compressor's scheme name: FP8 weights with one scale per output channel, dynamic "
                   "per-token FP8 activations where the device has FP8 matmuls")
    p.add_argument("--rounding", default="gptq", choices=["gptq", "rtn"],
                   help="gptq: error-compensating rounding on calibration text (Frantar et al. 2023); rtn: "
                   "round to nearest, no calibration")
    p.add_argument("--calibration-file", default=None,
                   help="UTF-8 text to calibrate on (default: stdlib module docstrings)")
    p.add_argument("--calibration-tokens", type=int, default=2048,
                   help="tokens of calibration text used, in windows of --calibration-window (default 2048)")
    p.add_argument("--calibration-window", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads (default: torch's)")
    return p


def quantize(args) -> dict:
    """Run the quantization ``args`` asks for; returns the summary written to kvfleet_quantize.json.
    Raises ValueError / UnsupportedFeatureError naming the flag for bad input, before any calibration."""
    import torch

    from ..config import resolve_model
    from ..evaluate import export_float_checkpoint
    from ..model.layers.quant.fp8 import quantize_per_channel_fp8
    from ..model.checkpoint import is_gguf
    from ..model.hf_reader import read_hf_config, read_hf_tensors
    from .gptq import gptq_fp8
    from .writer import quantize_tensors, write_fp8_checkpoint

    if args.calibration_window < 1 or args.calibration_tokens < args.calibration_window:
        raise ValueError(f"--calibration-tokens ({args.calibration_tokens}) must be at least --calibration-window "
                         f"({args.calibration_window}), which must be positive")
    src = resolve_model(args.model)
    _check_output(src, args.output)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tmp = None
    if is_gguf(src):  # the float checkpoint the GGUF dequantizes to
        tmp = tempfile.TemporaryDirectory(prefix="kvfleet-quantize-")
        try:
            src = export_float_checkpoint(src, tmp.name)
        except ValueError as e:
            tmp.cleanup()
            raise ValueError(f"--model {args.model!r}: {e}") from e
    try:
        cfg = read_hf_config(src)  # refuses an unsupported architecture or quantization_config by name
        if cfg.checkpoint_quantization is not None:
            raise ValueError(f"--model {args.model!r} is already quantized ({cfg.checkpoint_quantization}); "
                             "kvfleet-quantize needs a float checkpoint")
        t0 = time.perf_counter()
        info = {"scheme": args.scheme, "rounding": args.rounding, "source": args.model or "smollm2"}
        if args.rounding == "gptq":
            hessians, calib = _calibrate(src, args)
            info.update(calib)
            round_fn = lambda i, proj, w: gptq_fp8(w, hessians[f"layers.{i}.{proj}"])  # noqa: E731
        else:
            round_fn = lambda i, proj, w: quantize_per_channel_fp8(w)  # noqa: E731
        tensors = quantize_tensors(read_hf_tensors(src), round_fn)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        write_fp8_checkpoint(src, args.output, tensors, info)
        return info
    finally:
        if tmp is not None:
            tmp.cleanup()


def _check_output(src: str, out: str) -> None:
    """Refuse an --output that is the source or already holds weights (a stale shard index would be
    loaded instead of the new file)."""
    if os.path.realpath(out) == os.path.realpath(src):
        raise ValueError(f"--output {out!r} is the --model directory; write the FP8 checkpoint elsewhere")
    if os.path.isdir(out):
        held = sorted(f for f in os.listdir(out) if f.endswith((".safetensors", ".index.json", ".bin")))
        if held:
            raise ValueError(f"--output {out!r} already holds weights ({', '.join(held[:3])}); choose an empty "
                             "or new directory")


def _calibrate(src: str, args) -> tuple[dict, dict]:
    """H = Σ xᵀx per decoder projection over the calibration text (``collect_hessians``), and what was
    used: {"calibration_tokens", "calibration_text_sha256", "calibration_source"}."""
    import hashlib
    import platform

    from .. import LLM
    from ..evaluate import fixed_windows
    from ..model.tokenizer import Tokenizer
    from .calibration import calibration_text, collect_hessians

    if args.calibration_file:
        with open(args.calibration_file, encoding="utf-8") as f:
            text, source = f.read(), args.calibration_file
    else:
        text, source = calibration_text(), f"stdlib module docstrings (Python {platform.python_version()})"
    ids = Tokenizer.from_path(src, []).encode(text, add_special_tokens=False)
    count = min(args.calibration_tokens, len(ids)) // args.calibration_window
    if count < 1:
        raise ValueError(f"the calibration text ({args.calibration_file or 'default'}) has {len(ids)} tokens; at "
                         f"least --calibration-window {args.calibration_window} are needed")
    llm = LLM(src, device="cpu", dtype="float32", cpu_weight_prepack=False, kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=max(512, args.calibration_window), max_num_seqs=8,
              max_model_len=args.calibration_window + 16, enable_prefix_caching=False)
    try:
        hessians = collect_hessians(llm, fixed_windows(ids, args.calibration_window, count))
    finally:
        llm.engine.shutdown()
    return hessians, {"calibration_tokens": count * args.calibration_window, "calibration_source": source,
                      "calibration_text_sha256": hashlib.sha256(text.encode()).hexdigest()}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ..errors import UnsupportedFeatureError

    try:
        info = quantize(args)
    except (ValueError, UnsupportedFeatureError, OSError) as e:
        print(f"kvfleet-quantize: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.abspath(args.output)} ({info['scheme']}, {info['rounding']} rounding"
          f"{', ' + str(info['calibration_tokens']) + ' calibration tokens' if 'calibration_tokens' in info else ''}"
          f", {info['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
