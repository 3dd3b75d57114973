"""Build and load kvfleet's C++ CPU paged-attention kernel (``csrc/paged_attention_cpu.cpp``).

Built with ``torch.utils.cpp_extension.load`` (g++ and ninja; ``make`` installs ninja with the
project), cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a folder
named after the source and this CPU's instruction-set flags, so a restart loads the cached library
(milliseconds) and a shared cache never hands a library built for another CPU. The first build
takes tens of seconds; ``main()`` builds it ahead of time (the Makefile does, after installing).

``load()`` returns None, with the reason in ``load_error()``, when no compiler is there: the engine
then falls back to the torch reference backend and says so in the log.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
_state: dict = {}


def _cpu_fingerprint() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _cflags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        flags.append("-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native")
    return flags


def load():
    """The ``torch.ops.kvfleet.paged_attention_cpu`` op (building it on first use), or None when it
    cannot be built here (see ``load_error``)."""
    if "op" in _state:
        return _state["op"]
    op = None
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=f"kvfleet_cpu_attn_{_cpu_fingerprint()}", sources=[str(SOURCE)],
                           extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=False)
        op = torch.ops.kvfleet.paged_attention_cpu
    except Exception as exc:  # no compiler / ninja / headers: the torch backend serves instead
        _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("CPU paged-attention kernel unavailable (%s); using the torch reference backend",
                    _state["error"])
    _state["op"] = op
    return op


def load_error() -> str | None:
    """Why ``load()`` returned None (None when it has not failed)."""
    return _state.get("error")


def main() -> int:
    """Build (or load the cached) kernel and say so; 0 when it is ready. The Makefile runs it after
    installing: ``python -c 'from kvfleet_server.attention.cpu_ext import main; main()'``."""
    import time

    t0 = time.perf_counter()
    ok = load() is not None
    print(f"kvfleet CPU paged attention: {'ready' if ok else 'unavailable: ' + str(load_error())} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1
