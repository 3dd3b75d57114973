"""Build and load kvfleet's C++ CPU kernels, one library from ``csrc/``: paged attention per row
(``paged_attention_cpu.cpp``) and per span (``paged_span_attention_cpu.cpp``), sharing ``softmax.h``; a
decoder layer's fused element-wise ops (``layer_ops_cpu.cpp``: RMSNorm, residual add + RMSNorm, RoPE,
SiLU-and-mul) and the float32 panel linear (``linear_cpu.cpp``),
sharing ``vec_avx2.h`` (AVX2 helpers) and ``panel_tile.h`` (the 6 x 16 micro-kernel of the linear and the
span attention kernel).

Built with ``torch.utils.cpp_extension.load`` (g++, and ninja: the ``ninja`` package installed with the
project, found next to this interpreter) for a portable instruction-set level — x86-64-v3 (AVX2 + FMA:
every x86 server CPU since 2013) where the CPU has it, else baseline x86-64 / armv8-a — so a library
built once (``make``, a container image's build stage) runs on any machine of that level. It lives
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in ``kvfleet/<name>``, the name
carrying the level and a hash of the source (its text and its path: torch rebuilds when the source path
in its build file changes, so two checkouts must not share a folder), the flags, torch's and Python's
versions: a restart loads the cached library directly (``torch.ops.load_library``, milliseconds: the name
already hashes every input, so neither ninja's check nor ``cpp_extension`` is needed), and
different sources, checkouts or toolchains never share a folder. The first build takes tens of seconds; ``main()`` builds it ahead of
time (the Makefile runs it after installing). A build lock older than ``STALE_LOCK_S`` (a build killed
midway) is removed rather than waited on forever.

``load()`` returns None, with the reason in ``load_error()``, when it cannot be built or loaded (no
compiler, no ninja): the engine then serves with the torch reference backend and torch's layer ops,
with float32 linears in oneDNN's layout, and says so in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention_cpu.cpp", CSRC / "paged_span_attention_cpu.cpp", CSRC / "layer_ops_cpu.cpp",
           CSRC / "linear_cpu.cpp")
HEADERS = (CSRC / "vec_avx2.h", CSRC / "panel_tile.h", CSRC / "softmax.h")
STALE_LOCK_S = 600
_X86_V3 = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}
_state: dict = {}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_level() -> str:
    """The -march level the kernel is built for on this CPU."""
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        return "x86-64-v3" if _X86_V3 <= _cpu_flags() else "x86-64"
    if machine in ("aarch64", "arm64"):
        return "armv8-a"
    return ""


def _cflags() -> list[str]:
    level = isa_level()
    # no contraction of a * b + c into FMAs outside the explicit intrinsics: the element-wise ops then
    # round like torch's operator-by-operator reference
    return ["-O3", "-fopenmp", "-ffp-contract=off"] + ([f"-march={level}"] if level else [])


def _name() -> str:
    files = [part for f in SOURCES + HEADERS for part in (f.read_bytes(), str(f).encode())]
    key = b"\0".join(files + [" ".join(_cflags()).encode(), torch.__version__.encode(), sys.version.encode(),
                              os.environ.get("CXX", "").encode()])
    return f"kvfleet_cpu_ops_{isa_level().replace('-', '_') or 'generic'}_{hashlib.sha1(key).hexdigest()[:10]}"


def build_directory(name: str) -> str:
    import torch._appdirs  # what cpp_extension.get_default_build_root uses, without importing cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(
        torch._appdirs.user_cache_dir(appname="torch_extensions"))
    path = os.path.join(root, "kvfleet", name)
    os.makedirs(path, exist_ok=True)
    return path


def _clear_stale_lock(path: str) -> None:
    lock = os.path.join(path, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale CPU-kernel build lock (%.0f s old, a build killed midway): %s", age, lock)
        try:
            os.remove(lock)
        except OSError:
            pass


def _load_built(path: str, name: str) -> bool:
    """Load the library a finished build left in ``path`` without importing ``torch.utils.cpp_extension``
    (and setuptools: ~0.3 s) or running ninja's up-to-date check: ``name`` already hashes every input of
    the build. "Finished" is the ``<name>.ok`` marker ``load`` writes after ``cpp_extension.load``
    succeeded — not the .so alone, which a link killed midway leaves truncated (loading one can kill
    the process with SIGBUS). False when there is none or it does not load: ``cpp_extension.load``
    then checks (and rebuilds) it."""
    so, ok = os.path.join(path, f"{name}.so"), os.path.join(path, f"{name}.ok")
    if not (os.path.isfile(ok) and os.path.isfile(so)):
        return False
    try:
        torch.ops.load_library(so)
        return True
    except OSError as exc:
        log.warning("cached CPU-kernel library %s does not load (%s); checking the build again", so, exc)
        try:
            os.remove(ok)
        except OSError:
            pass
        return False


def _mark_built(path: str, name: str) -> None:
    try:
        with open(os.path.join(path, f"{name}.ok"), "w") as f:
            f.write("built\n")
    except OSError:
        pass  # a read-only cache: the next start checks with ninja again


def load():
    """The ``torch.ops.kvfleet.paged_attention_cpu`` op (building the kernel library on first use; the
    layer ops ``torch.ops.kvfleet.*_cpu`` and ``linear_packed_cpu`` are then registered too), or None when
    it cannot be built here (see ``load_error``)."""
    if "op" in _state:
        return _state["op"]
    op = None
    try:
        bindir = os.path.dirname(sys.executable)  # the venv's ninja, also when the venv is not activated
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        name = _name()
        path = build_directory(name)
        _clear_stale_lock(path)
        if not _load_built(path, name):
            from torch.utils import cpp_extension

            cpp_extension.load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=_cflags(),
                               extra_ldflags=["-fopenmp"], build_directory=path, is_python_module=False, verbose=False)
            _mark_built(path, name)
        op = torch.ops.kvfleet.paged_attention_cpu
        _register_fakes()
    except Exception as exc:  # no compiler / ninja / headers: the torch backend serves instead
        msg = str(exc).strip()
        _state["error"] = f"{type(exc).__name__}: {msg.splitlines()[-1] if msg else ''}"
        log.warning("kvfleet's CPU kernels unavailable (%s); paged attention and the layer ops use the torch "
                    "reference, float32 linears oneDNN's layout", _state["error"])
    _state["op"] = op
    return op


def _register_fakes() -> None:
    """Shape functions of the linear ops, so that torch.compile traces layers that call them (the
    int8 panel linear runs inside the compiled pieces at -O3)."""

    def linear_fake(x, wp, n, bias):
        return x.new_empty(x.shape[0], n)

    def linear_int8_fake(x, wp, scales, n, bias):
        return x.new_empty(x.shape[0], n)

    torch.library.register_fake("kvfleet::linear_packed_cpu", linear_fake)
    torch.library.register_fake("kvfleet::linear_packed_int8_cpu", linear_int8_fake)


def load_error() -> str | None:
    """Why ``load()`` returned None (None when it has not failed)."""
    return _state.get("error")


def main() -> int:
    """Build (or load the cached) kernel and say so; 0 when it is ready. The Makefile runs it after
    installing: ``python -c 'from kvfleet_server.attention.cpu_ext import main; main()'``."""
    t0 = time.perf_counter()
    ok = load() is not None
    print(f"kvfleet CPU kernels ({isa_level() or 'generic'}): "
          f"{'ready' if ok else 'unavailable: ' + str(load_error())} ({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1
