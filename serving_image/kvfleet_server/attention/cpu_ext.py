"""Build and load kvfleet's C++ CPU kernels, one library from ``csrc/``: paged attention per row
(``paged_attention_cpu.cpp``) and per span (``paged_span_attention_cpu.cpp``), sharing ``softmax.h``; a
decoder layer's fused element-wise ops (``layer_ops_cpu.cpp``: RMSNorm, residual add + RMSNorm, RoPE,
SiLU-and-mul) and the float32 panel linear (``linear_cpu.cpp``),
sharing ``vec_avx2.h`` (AVX2 helpers) and ``panel_tile.h`` (the register-blocked micro-kernels of the
linear and the span attention kernel).

Built with ``torch.utils.cpp_extension.load`` (g++, and ninja: the ``ninja`` package installed with the
project, found next to this interpreter) for one instruction-set level, chosen at run time from the
CPU's flags (``isa_level``): x86-64-v4 (AVX-512 F/BW/CD/DQ/VL: Intel Xeon since Skylake-SP, AMD since
Zen 4), else x86-64-v3 (AVX2 + FMA: every x86 server CPU since 2013), else baseline x86-64 / armv8-a.
``KVFLEET_CPU_ISA=x86-64-v3`` (or ``x86-64``) forces a lower level, e.g. to compare builds on one machine;
a level the CPU lacks is refused with ValueError. A library built for a level runs on any machine of
that level; a CPU image's build stage builds every level (``main(["--all-levels"])``), so the image
runs its best build on whatever CPU a node has. A build lives under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) in ``kvfleet/<name>``, the name carrying the level and a hash of the source
(its text and its path: torch rebuilds when the source path in its build file changes, so two checkouts
must not share a folder), the flags, torch's and Python's versions: a restart loads the cached library
directly (``torch.ops.load_library``, milliseconds: the name already hashes every input, so neither
ninja's check nor ``cpp_extension`` is needed), and different sources, checkouts, levels or toolchains
never share a folder. The first build takes tens of seconds; ``main()`` builds it ahead of time (the
Makefile runs it after installing). A build lock older than ``STALE_LOCK_S`` (a build killed midway) is
removed rather than waited on forever.

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
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_LEVELS = ("x86-64", "x86-64-v3", "x86-64-v4")  # lowest first
ISA_ENV = "KVFLEET_CPU_ISA"  # force a lower level than the CPU's (e.g. x86-64-v3 on an AVX-512 host)
_state: dict = {}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_levels() -> tuple[str, ...]:
    """The -march levels this CPU runs, lowest first: x86-64 always on x86, x86-64-v3 with AVX2 + FMA,
    x86-64-v4 with AVX-512 F/BW/CD/DQ/VL as well; ("armv8-a",) on Arm, () elsewhere."""
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        flags = _cpu_flags()
        return X86_LEVELS[:1 + (_X86_V3 <= flags) + (_X86_V4 <= flags)]
    if machine in ("aarch64", "arm64"):
        return ("armv8-a",)
    return ()


def isa_level() -> str:
    """The -march level the kernels are built for: the highest this CPU runs, or the one ``KVFLEET_CPU_ISA``
    names. Raises ValueError naming the variable when it names a level this CPU lacks or none at all."""
    levels = supported_levels()
    forced = os.environ.get(ISA_ENV, "").strip()
    if not forced:
        return levels[-1] if levels else ""
    if forced not in levels:
        raise ValueError(f"{ISA_ENV}={forced!r}: this CPU runs {', '.join(levels) or 'no kvfleet kernel build'}")
    return forced


def cpu_description() -> str:
    """The CPU model, its vector flags and the kernel build this process loads (``KVFLEET_CPU_ISA``
    included), for benchmark output: e.g. ``Intel(R) Xeon(R) Processor [amx_bf16 ... avx2 avx512f ...]
    (2 CPUs, kernels built for x86-64-v4)``."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    shown = sorted(f for f in _cpu_flags() if f.startswith(("avx", "amx", "fma")))
    return (f"{model or platform.processor() or platform.machine()} [{' '.join(shown)}] "
            f"({os.cpu_count()} CPUs, kernels built for {isa_level() or 'generic'})")


def _cflags(level: str) -> list[str]:
    # no contraction of a * b + c into FMAs outside the explicit intrinsics: the element-wise ops then
    # round like torch's operator-by-operator reference
    return ["-O3", "-fopenmp", "-ffp-contract=off"] + ([f"-march={level}"] if level else [])


def _name(level: str) -> str:
    files = [part for f in SOURCES + HEADERS for part in (f.read_bytes(), str(f).encode())]
    key = b"\0".join(files + [" ".join(_cflags(level)).encode(), torch.__version__.encode(), sys.version.encode(),
                              os.environ.get("CXX", "").encode()])
    return f"kvfleet_cpu_ops_{level.replace('-', '_') or 'generic'}_{hashlib.sha1(key).hexdigest()[:10]}"


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
    it cannot be built here (see ``load_error``). Raises ValueError when ``KVFLEET_CPU_ISA`` names a level
    this CPU lacks."""
    if "op" in _state:
        return _state["op"]
    isa_level()  # a KVFLEET_CPU_ISA this CPU cannot run is the user's error: raised, not served around
    op = None
    try:
        _ensure_ninja_on_path()
        level = isa_level()
        name = _name(level)
        path = build_directory(name)
        _clear_stale_lock(path)
        if not _load_built(path, name):
            from torch.utils import cpp_extension

            cpp_extension.load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=_cflags(level),
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


def _ensure_ninja_on_path() -> None:
    bindir = os.path.dirname(sys.executable)  # the venv's ninja, also when the venv is not activated
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def build_only(level: str) -> str:
    """Build the library for ``level`` without loading it — a container image's build stage builds
    every level of its architecture, so that the image runs its best build on whatever CPU a node has.
    Returns the build folder. Uses ``cpp_extension``'s (private) ninja builder, passing the arguments
    this torch's version takes, under the build folder's lock as ``cpp_extension.load`` does; raises when
    the build fails."""
    import inspect

    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    _ensure_ninja_on_path()
    name = _name(level)
    path = build_directory(name)
    _clear_stale_lock(path)
    baton = FileBaton(os.path.join(path, "lock"))  # the lock cpp_extension.load takes: one build per folder
    if baton.try_acquire():
        try:
            if not os.path.isfile(os.path.join(path, f"{name}.ok")):
                build = cpp_extension._write_ninja_file_and_build_library
                kwargs = dict(name=name, sources=[str(f) for f in SOURCES], extra_cflags=_cflags(level),
                              extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=["-fopenmp"],
                              extra_include_paths=[], build_directory=path, verbose=False, with_cuda=False,
                              with_sycl=False)
                accepted = inspect.signature(build).parameters  # torch versions differ (SYCL arguments)
                build(**{k: v for k, v in kwargs.items() if k in accepted})
                _mark_built(path, name)
        finally:
            baton.release()
    else:
        baton.wait()  # another process builds it
        if not os.path.isfile(os.path.join(path, f"{name}.ok")):
            raise RuntimeError(f"the concurrent build of {name} in {path} did not finish")
    return path


def main(argv: list[str] | None = None) -> int:
    """Build (or load the cached) kernels for this CPU and say so; 0 when they are ready. The Makefile
    runs it after installing: ``python -c 'from kvfleet_server.attention.cpu_ext import main; main()'``;
    with ``--all-levels`` (the CPU image's build stage) it also builds every other level of this
    architecture (x86-64, x86-64-v3, x86-64-v4), not loaded here."""
    import argparse

    ap = argparse.ArgumentParser(prog="cpu_ext.main", description=main.__doc__.split("\n")[0])
    ap.add_argument("--all-levels", action="store_true", help="also build the levels this CPU does not use")
    args = ap.parse_args([] if argv is None else argv)
    t0 = time.perf_counter()
    ok = load() is not None
    print(f"kvfleet CPU kernels ({isa_level() or 'generic'}): "
          f"{'ready' if ok else 'unavailable: ' + str(load_error())} ({time.perf_counter() - t0:.1f} s)")
    if args.all_levels and platform.machine() in ("x86_64", "AMD64"):
        for level in X86_LEVELS:
            if level != isa_level():
                t0 = time.perf_counter()
                build_only(level)
                print(f"kvfleet CPU kernels ({level}): built, not loaded here ({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1

