"""A disk cache of decoded GGUF files: a restart skips the GGUF parse and the dequantization.

Parsing a GGUF's metadata (SmolLM2's 49,152-token vocabulary and merges) and dequantizing its Q4_1
tensors to float32 take 2-4 s of a 2-core machine's start-up, and give the same result every time. The
first start saves what ``read_gguf_config`` and ``read_gguf_tensors`` returned — the ModelConfig, the
architecture and the tensors (float32 tensors as they are, ``GGUFTensor`` blocks as their raw bytes) —
in one safetensors file; later starts read it back (one sequential read from the page cache).

- Where: ``$KVFLEET_GGUF_CACHE``, else ``$XDG_CACHE_HOME/kvfleet/gguf`` (``~/.cache/kvfleet/gguf``);
  ``KVFLEET_GGUF_CACHE=off`` turns the cache off.
- Key: the file's absolute path, size and mtime, whether its Q4_0/Q4_1/Q8_0 tensors are kept packed
  (``--quantization gguf``) or dequantized, the gguf library's version and ``FORMAT`` — a changed file,
  library or layout misses and writes a new entry (the file's older entries are removed).
- Safety: an entry is written to a temporary file and renamed into place (a concurrent start sees a
  whole entry or none); an entry that cannot be read is removed and the GGUF parsed again; a cache
  that cannot be written (read-only root file system) only costs the parse at each start.
- Size: float32 tensors take 4 bytes per weight on disk (SmolLM2: 540 MB); packed ones their GGUF
  size (~100 MB).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import tempfile

import torch

from .config import ModelConfig
from .layers.quant.gguf import GGUFTensor

log = logging.getLogger("kvfleet.engine")

#: bump when what read_gguf_config / read_gguf_tensors return changes for the same file
FORMAT = 1
_META = "kvfleet.gguf_cache"


def gguf_cache_dir() -> str | None:
    """The cache folder, or None when ``KVFLEET_GGUF_CACHE=off``."""
    from .compile import kvfleet_cache_dir

    d = kvfleet_cache_dir("gguf", "KVFLEET_GGUF_CACHE")
    return None if d.lower() in ("off", "0", "none") else d


def entry_path(path: str, packed: bool) -> str | None:
    """The cache file of ``path`` decoded with or without packed tensors (None: cache off)."""
    from importlib.metadata import version

    d = gguf_cache_dir()
    if d is None:
        return None
    src = os.path.abspath(path)
    st = os.stat(src)
    key = "\0".join([src, str(st.st_size), str(st.st_mtime_ns), _mode(packed),
                     version("gguf"), str(FORMAT)])
    prefix = hashlib.sha1(src.encode()).hexdigest()[:12]
    return os.path.join(d, f"{prefix}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.safetensors")


def load(path: str, packed: bool) -> tuple[ModelConfig, str, dict] | None:
    """(ModelConfig, GGUF architecture, tensors) saved by an earlier start, or None on a miss.

    The tensors are what ``read_gguf_tensors(reader, cfg, packed)`` returned: float32 tensors, and with
    ``packed`` ``GGUFTensor``s (raw blocks) for the Q4_0/Q4_1/Q8_0 matrices."""
    entry = entry_path(path, packed)
    if entry is None or not os.path.isfile(entry):
        return None
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(entry, framework="pt") as f:
            meta = json.loads(f.metadata()[_META])
        tensors: dict = load_file(entry)
        for name, (type_name, rows, cols) in meta["packed"].items():
            tensors[name] = GGUFTensor(type_name, tensors[name].numpy(), (rows, cols))
        return ModelConfig(**meta["config"]), meta["architecture"], tensors
    except Exception as exc:  # a damaged or foreign entry: parse the GGUF again
        log.warning("GGUF cache entry %s unreadable (%s); parsing %s again", entry, exc, path)
        _remove(entry)
        return None


def save(path: str, packed: bool, cfg: ModelConfig, architecture: str, tensors: dict) -> None:
    """Save one decoded GGUF (see ``load``); never raises (logs why an entry was not written)."""
    try:
        entry = entry_path(path, packed)
        if entry is None:
            return
        from safetensors.torch import save_file

        flat, kinds = {}, {}
        for name, t in tensors.items():
            if isinstance(t, GGUFTensor):
                import numpy as np

                flat[name] = torch.from_numpy(np.array(t.raw))  # a writable copy of the file's blocks
                kinds[name] = (t.type_name, *t.shape)
            else:
                flat[name] = t.contiguous()
        meta = {"config": dataclasses.asdict(cfg), "architecture": architecture, "packed": kinds,
                "mode": _mode(packed)}
        folder = os.path.dirname(entry)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(flat, tmp, metadata={_META: json.dumps(meta)})
            os.chmod(tmp, 0o644)  # a cache shared between users
            os.replace(tmp, entry)
        finally:
            _remove(tmp)
        stale = [p for p in glob.glob(os.path.join(folder, os.path.basename(entry)[:13] + "*.safetensors"))
                 if p != entry and _same_mode(p, packed)]
        for p in stale:  # the same file before it changed, or decoded by an older library
            _remove(p)
        log.info("GGUF cache: saved %s (%.0f MB) for the next start", entry, os.path.getsize(entry) / 1e6)
    except Exception as exc:  # the cache is an optimisation: never a reason not to start
        log.info("GGUF cache not written (%s): %s is parsed at each start", exc, path)


def _mode(packed: bool) -> str:
    return "packed" if packed else "float"


def _same_mode(entry: str, packed: bool) -> bool:
    try:
        from safetensors import safe_open

        with safe_open(entry, framework="pt") as f:
            return json.loads(f.metadata()[_META])["mode"] == _mode(packed)
    except Exception:
        return True  # unreadable: stale anyway


def _remove(p: str) -> None:
    try:
        os.remove(p)
    except OSError:
        pass
