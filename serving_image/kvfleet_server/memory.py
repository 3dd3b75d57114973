"""Resident memory of the serving process: give the C heap's freed pages back to the OS after the
engine is built.

Loading frees most of what it allocates (the GGUF parse, transformers' tokenizer conversion from the
GGUF metadata, the float copies of quantize-at-load weights), but glibc's malloc keeps freed chunks of
its arenas mapped, so they stay in the process's RSS. ``malloc_trim(0)`` (glibc, man 3 malloc_trim)
returns them: on the bundled SmolLM2 server about 80 MB (docs/quantization.md). A no-op where the C
library has no ``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def resident_bytes() -> int | None:
    """This process's VmRSS in bytes (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_freed_heap() -> bool:
    """Collect garbage, then return the heap's free pages to the OS. True when ``malloc_trim`` ran."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
