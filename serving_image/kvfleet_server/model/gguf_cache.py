"""A disk cache of decoded GGUF files: a restart skips the GGUF parse and the dequantization.

Parsing a GGUF's metadata (SmolLM2's 49,152-token vocabulary and merges) and dequantizing its Q4_1
tensors to float32 take 2-4 s of a 2-core machine's start-up, and give the same result every time. The
first start saves what ``read_gguf_config`` and ``read_gguf_tensors`` returned — the ModelConfig, the
architecture and the tensors (float32 tensors as they are, ``GGUFTensor`` blocks as their raw bytes) —
in one safetensors file; later starts read it back (one sequential read from the page cache).

- Where: ``$KVFLEET_GGUF_CACHE``, else ``$XDG_CACHE_HOME/kvfleet/gguf`` (``~/.cache/kvfleet/gguf``);
  ``KVFLEET_GGUF_CACHE=off`` (or 0, false, no, none) turns the cache off.
- Key (``Source``): the file's absolute path, device, inode, size, mtime and ctime (``utime`` cannot
  set ctime: a file rewritten in place with its old mtime restored still misses), whether its
  Q4_0/Q4_1/Q8_0 tensors are kept packed (``--quantization gguf``) or dequantized, the gguf library's
  version and a hash of the code that decodes (gguf_reader.py, config.py, quant/gguf.py, this file) — a
  changed file, library or decoder misses and writes a new entry.
- The key is taken before the file is read and checked again before the entry is published: a file
  replaced during the start is not cached under its new identity.
- Safety: an entry is written to a temporary file and renamed into place (a concurrent start sees a
  whole entry or none); an entry that cannot be read is removed and the GGUF parsed again; any failure
  of the cache (a read-only root file system, a missing package version) only costs the parse.
- Clean-up: writing an entry removes this file's entries whose recorded file identity no longer
  matches (the file changed), and temporary files older than an hour (a save that was killed); entries
  of the same file for other library versions are kept (two installs share the folder).
- Size: float32 tensors take 4 bytes per weight on disk (SmolLM2: 540 MB); packed ones their GGUF
  size (~100 MB). There is no size cap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from .config import ModelConfig
from .layers.quant.gguf import GGUFTensor

log = logging.getLogger("kvfleet.engine")

_META = "kvfleet.gguf_cache"
_OFF = ("off", "0", "false", "no", "none")
_TMP_MAX_AGE_S = 3600
#: the code whose output is cached: an edit to any of them changes every key
_DECODERS = (Path(__file__), Path(__file__).with_name("gguf_reader.py"), Path(__file__).with_name("config.py"),
             Path(__file__).parent / "layers" / "quant" / "gguf.py")


def gguf_cache_dir() -> str | None:
    """The cache folder, or None when ``KVFLEET_GGUF_CACHE`` turns it off."""
    from .compile import kvfleet_cache_dir

    d = kvfleet_cache_dir("gguf", "KVFLEET_GGUF_CACHE")
    return None if d.strip().lower() in _OFF else d


def _identity(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


@dataclasses.dataclass(frozen=True)
class Source:
    """One GGUF file as it was when a start began reading it, and its cache entry (None: cache off)."""

    path: str
    packed: bool
    identity: tuple[int, ...]
    entry: str | None

    @classmethod
    def of(cls, path: str, packed: bool) -> "Source":
        """Never raises for a cache problem: the entry is None then (the file's own errors surface
        when it is opened)."""
        src = os.path.abspath(path)
        try:
            ident = tuple(_identity(src))
            d = gguf_cache_dir()
            if d is None:
                return cls(src, packed, ident, None)
            from importlib.metadata import version

            code = hashlib.sha1(b"".join(p.read_bytes() for p in _DECODERS)).hexdigest()
            key = "\0".join([src, *map(str, ident), _mode(packed), version("gguf"), code])
            prefix = hashlib.sha1(src.encode()).hexdigest()[:12]
            entry = os.path.join(d, f"{prefix}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.safetensors")
            return cls(src, packed, ident, entry)
        except Exception as exc:  # the cache is an optimisation: never a reason not to start
            log.info("GGUF cache off for %s (%s)", path, exc)
            return cls(src, packed, (), None)

    def unchanged(self) -> bool:
        try:
            return tuple(_identity(self.path)) == self.identity
        except OSError:
            return False


def load(source: Source) -> tuple[ModelConfig, str, dict] | None:
    """(ModelConfig, GGUF architecture, tensors) saved by an earlier start, or None on a miss.

    The tensors are what ``read_gguf_tensors(reader, cfg, packed)`` returned: float32 tensors, and with
    ``packed`` ``GGUFTensor``s (raw blocks) for the Q4_0/Q4_1/Q8_0 matrices."""
    entry = source.entry
    if entry is None or not os.path.isfile(entry):
        return None
    try:
        from safetensors import safe_open

        with safe_open(entry, framework="pt") as f:  # one open for the metadata and the tensors
            meta = json.loads(f.metadata()[_META])
            tensors: dict = {k: f.get_tensor(k) for k in f.keys()}
        for name, (type_name, rows, cols) in meta["packed"].items():
            tensors[name] = GGUFTensor(type_name, tensors[name].numpy(), (rows, cols))
        return ModelConfig(**meta["config"]), meta["architecture"], tensors
    except Exception as exc:  # a damaged or foreign entry: parse the GGUF again
        log.warning("GGUF cache entry %s unreadable (%s); parsing %s again", entry, exc, source.path)
        _remove(entry)
        return None


def save(source: Source, cfg: ModelConfig, architecture: str, tensors: dict) -> None:
    """Save one decoded GGUF (see ``load``) unless the file changed since ``source`` was taken; never
    raises (logs why an entry was not written)."""
    entry = source.entry
    if entry is None:
        return
    tmp = None
    try:
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
                "mode": _mode(source.packed), "identity": list(source.identity)}
        folder = os.path.dirname(entry)
        os.makedirs(folder, exist_ok=True)
        _clean(folder, source)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        save_file(flat, tmp, metadata={_META: json.dumps(meta)})
        if not source.unchanged():
            log.info("GGUF cache not written: %s changed while it was read", source.path)
            return
        os.chmod(tmp, 0o644)  # a cache shared between users
        os.replace(tmp, entry)
        tmp = None
        log.info("GGUF cache: saved %s (%.0f MB) for the next start", entry, os.path.getsize(entry) / 1e6)
    except Exception as exc:  # the cache is an optimisation: never a reason not to start
        log.info("GGUF cache not written (%s): %s is parsed at each start", exc, source.path)
    finally:
        if tmp is not None:
            _remove(tmp)


def _mode(packed: bool) -> str:
    return "packed" if packed else "float"


def _read_meta(entry: str) -> dict:
    from safetensors import safe_open

    with safe_open(entry, framework="pt") as f:
        return json.loads(f.metadata()[_META])


def _clean(folder: str, source: Source) -> None:
    """Remove this file's entries recorded for another identity of it, and stale temporary files."""
    prefix = os.path.basename(source.entry)[:13]
    now = time.time()
    for name in os.listdir(folder):
        p = os.path.join(folder, name)
        if name.startswith(".tmp-"):
            try:
                if now - os.path.getmtime(p) > _TMP_MAX_AGE_S:
                    _remove(p)
            except OSError:
                pass
        elif name.startswith(prefix) and p != source.entry:
            try:
                stale = tuple(_read_meta(p)["identity"]) != source.identity
            except Exception:
                stale = True  # unreadable
            if stale:
                _remove(p)


def _remove(p: str) -> None:
    try:
        os.remove(p)
    except OSError:
        pass
