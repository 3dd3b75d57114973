"""Every build of kvfleet's CPU kernels that this CPU runs, against the float32 torch reference.

attention/cpu_ext.py builds the kernels for the highest level the CPU reports (x86-64-v4: AVX-512;
x86-64-v3: AVX2 + FMA; x86-64: the portable scalar loops), and ``KVFLEET_CPU_ISA`` forces a lower one. The
kernel test files ran in this process against the default build; here they run again, in a subprocess,
under every other level this CPU supports. Levels the CPU lacks are skipped, and the skip names them.
The AVX-512 and AVX2 panel linears must also give the same bits, because each output is one float32
FMA chain in k order in both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfleet_server.attention import cpu_ext

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/server/test_cpu_linear.py", "tests/server/test_cpu_attention.py",
                "tests/server/test_cpu_layer_ops.py", "tests/server/test_cpu_prepack.py"]
DEFAULT = cpu_ext.supported_levels()[-1] if cpu_ext.supported_levels() else ""


def _env(level: str) -> dict:
    env = dict(os.environ, KVFLEET_CPU_ISA=level)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _level_or_skip(level: str) -> None:
    if level not in cpu_ext.supported_levels():
        pytest.skip(f"this CPU cannot run the {level} build (it runs {', '.join(cpu_ext.supported_levels()) or 'none'})")
    if level == DEFAULT:
        pytest.skip(f"{level} is this CPU's default build: the kernel tests ran against it in this process")


@pytest.mark.parametrize("level", cpu_ext.X86_LEVELS)
def test_kernel_tests_pass_under_every_build_this_cpu_runs(level):
    _level_or_skip(level)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *KERNEL_TESTS],
                          cwd=ROOT, env=_env(level), capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "CPU kernels not built" not in out and " passed" in out, out[-2000:]


def test_unknown_or_unsupported_level_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_ext.ISA_ENV, "x86-64-v9")
    with pytest.raises(ValueError, match="KVFLEET_CPU_ISA='x86-64-v9': this CPU runs"):
        cpu_ext.isa_level()


_BITS_SCRIPT = """
import sys, torch
from kvfleet_server.attention import cpu_ext
from kvfleet_server.model.layers.cpu_prepack import pack_panels
assert cpu_ext.load() is not None, cpu_ext.load_error()
g = torch.Generator().manual_seed(11)
out = {"level": cpu_ext.isa_level()}
for m, k, n in [(1, 576, 40), (13, 1536, 31), (301, 576, 200)]:
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    out[f"f32-{m}"] = torch.ops.kvfleet.linear_packed_cpu(x, pack_panels(w), n, b)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.zeros(-(-n // 16) * 16)
    s[:n] = torch.rand(n, generator=g)
    out[f"int8-{m}"] = torch.ops.kvfleet.linear_packed_int8_cpu(x, pack_panels(q), s, n, b)
torch.save(out, sys.argv[1])
"""


def test_avx512_and_avx2_panel_linears_give_the_same_bits(tmp_path):
    if DEFAULT != "x86-64-v4":
        pytest.skip(f"needs a CPU that runs both x86-64-v4 and x86-64-v3 (this one: {DEFAULT or 'not x86'})")
    results = {}
    for level in ("x86-64-v4", "x86-64-v3"):
        path = tmp_path / f"{level}.pt"
        proc = subprocess.run([sys.executable, "-c", _BITS_SCRIPT, str(path)], cwd=ROOT, env=_env(level),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[level] = torch.load(path)
        assert results[level].pop("level") == level
    v4, v3 = results["x86-64-v4"], results["x86-64-v3"]
    assert v4.keys() == v3.keys()
    for key in v4:
        assert torch.equal(v4[key], v3[key]), key


@pytest.mark.skipif(not cpu_ext.supported_levels() or cpu_ext.supported_levels()[0] != "x86-64", reason="not x86")
def test_build_only_builds_a_level_without_loading_it():
    """What a CPU image's build stage runs (``cpu_ext.main(["--all-levels"])``, serving_image/Dockerfile.cpu):
    every level is built and marked finished, and only this CPU's is loaded."""
    other = next(level for level in cpu_ext.X86_LEVELS if level != cpu_ext.isa_level())
    name = cpu_ext._name(other)
    path = Path(cpu_ext.build_only(other))
    assert (path / f"{name}.so").is_file() and (path / f"{name}.ok").is_file()
    loaded = [lib for lib in torch.ops.loaded_libraries if "kvfleet_cpu_ops_" in lib]
    assert all(cpu_ext.isa_level().replace("-", "_") in lib for lib in loaded), loaded
