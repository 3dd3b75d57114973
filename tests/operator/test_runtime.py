"""Must-show 6 of issue 34: `spec.engine.runtime: vllm` renders `vllm serve` with the flags of the same spec, the
same probes, port and metrics; settings vLLM lacks are refused naming the field; the kvfleet runtime's rendering
is byte-identical to the pinned rendering (tests/operator/golden/: the output of `kvfleet-operator render
crds/samples/NAME.yaml`, first taken at d9465b0, before the runtime existed, and since changed only by intended
changes of the kvfleet rendering: issue 34's pod-shape defaults, then the KV-events and weights work — update a
golden only with such a change)."""
from __future__ import annotations

import collections
import copy
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from kmock_support import running_operator, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import cli, render, runtime, server_args
from kvfleet_server.flags import build_parser as kvfleet_parser
from test_torch_free_render import engine_field_specs

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
GPU_SAMPLES = [p for p in SAMPLES if "cpu" not in p.name]
HF = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}}


def isvc(spec: dict, name: str = "m") -> dict:
    return {"apiVersion": isvc_api.API_VERSION, "kind": isvc_api.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": spec}


def with_runtime(obj: dict, name: str) -> dict:
    obj = copy.deepcopy(obj)
    obj["spec"].setdefault("engine", {})["runtime"] = name
    return obj


def server(children: render.Children) -> dict:
    return children.deployment["spec"]["template"]["spec"]["containers"][0]


def _cli_render(path: Path, monkeypatch) -> str:
    for var in ("KVFLEET_SERVING_IMAGE", "KVFLEET_SERVING_IMAGE_PULL_POLICY", "KVFLEET_VLLM_IMAGE"):
        monkeypatch.delenv(var, raising=False)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["render", str(path)]) == 0
    return out.getvalue()


# --------------------------------------------------------------------------------- kvfleet unchanged
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_kvfleet_rendering_is_byte_identical_to_main(path, monkeypatch, tmp_path):
    golden = (GOLDEN / path.name).read_text()
    assert _cli_render(path, monkeypatch) == golden
    explicit = tmp_path / path.name
    explicit.write_text(yaml.safe_dump(with_runtime(yaml.safe_load(path.read_text()), "kvfleet")))
    assert _cli_render(explicit, monkeypatch) == golden  # runtime: kvfleet is the default, not a change


# ------------------------------------------------------------------------------------ vllm rendering
@pytest.mark.parametrize("path", GPU_SAMPLES, ids=lambda p: p.name)
def test_vllm_serves_the_same_flags_probes_port_and_metrics(path):
    obj = yaml.safe_load(path.read_text())
    kv, vl = render.render(obj), render.render(with_runtime(obj, "vllm"))
    a, b = server(kv), server(vl)
    assert a["command"] == ["kvfleet-server"] and b["command"] == ["vllm", "serve"]
    assert b["image"] == runtime.DEFAULT_VLLM_IMAGE and a["image"] == isvc_api.DEFAULT_IMAGE
    # vllm serve MODEL: the model positional, the same flags without kvfleet's --device (vLLM has none)
    model = a["args"][a["args"].index("--model") + 1]
    device = a["args"].index("--device")
    rest = [x for i, x in enumerate(a["args"]) if i not in (0, 1, device, device + 1)]
    assert b["args"] == [model] + rest
    assert "--speculative-config" not in a["args"] or \
        json.loads(b["args"][b["args"].index("--speculative-config") + 1])["method"] == "draft_model"
    # everything else of the children is the same: probes, port, metrics annotations, resources, volumes, ...
    def same(children: render.Children) -> dict:
        out = copy.deepcopy(children)
        pod = out.deployment["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            c.pop("image"), c.pop("command"), c.pop("args", None)
        return {"deployment": out.deployment, "service": out.service, "pdb": out.pdb}
    assert same(kv) == same(vl)
    pod = vl.deployment["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert b["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for init in pod["spec"].get("initContainers", []):  # downloads run kvfleet's downloader in kvfleet's image
        assert init["image"] == isvc_api.DEFAULT_IMAGE and init["command"] == ["kvfleet-download"]


def test_vllm_image_comes_from_the_operator_settings_or_the_spec():
    defaults = render.ServingDefaults.from_env({"KVFLEET_VLLM_IMAGE": "mirror.example/vllm-openai:v0.23.1",
                                                "KVFLEET_SERVING_IMAGE_PULL_POLICY": "Always"})
    box = server(render.render(isvc({**HF, "engine": {"runtime": "vllm"}}), defaults=defaults))
    assert (box["image"], box["imagePullPolicy"]) == ("mirror.example/vllm-openai:v0.23.1", "Always")
    box = server(render.render(isvc({**HF, "engine": {"runtime": "vllm", "image": "my/vllm:1"}}), defaults=defaults))
    assert box["image"] == "my/vllm:1"
    assert server(render.render(isvc(HF), defaults=defaults))["image"] == isvc_api.DEFAULT_IMAGE


def test_the_cli_renders_the_vllm_image_setting(tmp_path, monkeypatch):
    path = tmp_path / "v.yaml"
    path.write_text(yaml.safe_dump(with_runtime(isvc(HF), "vllm")))
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["render", str(path), "--vllm-image", "vllm/vllm-openai:v0.19.0"]) == 0
    dep = next(yaml.safe_load_all(out.getvalue()))
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.19.0"


# ------------------------------------------------------------------------------------------ refusals
REFUSED = [
    ("layer_skip", {"speculative": {"method": "layer_skip", "numSpeculativeTokens": 3, "numDraftLayers": 8}}, {},
     "spec.engine.speculative.method"),
    ("int8", {"quantization": "int8"}, {}, "spec.engine.quantization"),
    ("int4", {"quantization": "int4"}, {}, "spec.engine.quantization"),
    ("disableByBatchSize 1", {"speculative": {"method": "ngram", "numSpeculativeTokens": 2, "disableByBatchSize": 1}},
     {}, "spec.engine.speculative.disableByBatchSize"),
    ("jump-forward", {"extraArgs": ["--enable-jump-forward"]}, {}, "spec.engine.extraArgs"),
    ("kvfleet's CPU kernels", {"extraArgs": ["--no-cpu-fused-ops"]}, {}, "spec.engine.extraArgs"),
    ("CPU", {}, {"resources": {"gpus": 0}}, "spec.resources.gpus"),
    ("bundled model", {}, {"model": {"uri": "bundled://smollm2"}}, "spec.model.uri"),
]


@pytest.mark.parametrize("what,engine,spec,field", REFUSED, ids=[r[0] for r in REFUSED])
def test_settings_vllm_lacks_are_refused_naming_the_field(what, engine, spec, field):
    obj = isvc({**HF, **spec, "engine": {"runtime": "vllm", **engine}})
    with pytest.raises(render.Unrealisable) as err:
        render.render(obj)
    assert err.value.reason == "UnsupportedFeature"
    assert err.value.message.startswith(f"{field}: runtime vllm does not support ")
    assert "\n" not in err.value.message
    obj["spec"]["engine"]["runtime"] = "kvfleet"  # kvfleet-server has them all
    render.render(obj)


def test_vllm_accepts_what_both_runtimes_share():
    engine = {"runtime": "vllm", "quantization": "fp8", "kvCacheDtype": "fp8_e5m2", "tensorParallelSize": 2,
              "speculative": {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 4,
                              "disableByBatchSize": 8},
              "extraArgs": ["--max-num-partial-prefills", "2"]}  # vLLM's own flag: vLLM judges it
    args = server(render.render(isvc({**HF, "engine": engine})))["args"]
    assert args[args.index("--quantization") + 1] == "fp8" and args[-2:] == ["--max-num-partial-prefills", "2"]


async def test_the_reconcile_reports_a_refusal_as_degraded_naming_the_field(api, emulator):
    obj = yaml.safe_load((ROOT / "crds/samples/llama-3.1-8b-instruct.yaml").read_text())
    obj["metadata"]["namespace"] = "default"
    obj["spec"]["engine"].update(runtime="vllm", speculative={"method": "layer_skip", "numSpeculativeTokens": 3,
                                                               "numDraftLayers": 8})
    name = obj["metadata"]["name"]
    async with running_operator():
        await api.create(isvc_api.API_VERSION, isvc_api.PLURAL, "default", obj)

        async def degraded():
            live = await api.get(isvc_api.API_VERSION, isvc_api.PLURAL, "default", name)
            conds = {c["type"]: c for c in ((live or {}).get("status") or {}).get("conditions") or []}
            return conds.get("Degraded") if conds.get("Degraded", {}).get("status") == "True" else None
        c = await wait_for(degraded)
        assert c["reason"] == "UnsupportedFeature"
        assert c["message"].startswith("spec.engine.speculative.method: runtime vllm does not support ")
        assert await api.get("apps/v1", "deployments", "default", name) is None



# --------------------------------------------------------------------------------------- the table
def _emitted_flags() -> set[str]:
    flags = set()
    specs = [yaml.safe_load(p.read_text())["spec"] for p in SAMPLES] + [s for _, s in engine_field_specs()]
    for spec in specs:
        spec = copy.deepcopy(spec)
        spec.setdefault("engine", {})["extraArgs"] = []
        model = render.parse_spec(isvc(spec))
        paths = collections.defaultdict(lambda: "/m")  # every model uri's path (cache.PodStorage.paths)
        flags |= {a for a in server_args.server_args(model, paths) if a.startswith("--")}
    return flags


def test_the_table_covers_every_rendered_flag_and_kvfleet_has_every_flag_it_claims():
    rendered = _emitted_flags()
    assert rendered <= {f.flag for f in runtime.FLAGS if f.value is None and f.field != runtime.EXTRA_ARGS}
    assert set(isvc_api.RENDERED_FLAGS) == {f.flag for f in runtime.FLAGS if f.field != runtime.EXTRA_ARGS}
    options = {o for action in kvfleet_parser()._actions for o in action.option_strings}
    assert {f.flag for f in runtime.FLAGS if runtime.KVFLEET in f.runtimes} <= options
    assert set(isvc_api.EngineConfig.model_fields["runtime"].annotation.__args__) == set(runtime.RUNTIMES)


# --------------------------------------------------------------------------------- vLLM's own parser
def vllm_serve_parser():
    pytest.importorskip("vllm", reason="vllm is not installed here: the rendered `vllm serve` arguments cannot be "
                                       "parsed by vLLM's own argument parser")
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before 0.11
        from vllm.utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    if not any(a.dest == "model_tag" for a in parser._actions):
        parser.add_argument("model_tag", nargs="?")  # `vllm serve` adds it beside the frontend arguments
    return parser


@pytest.mark.parametrize("path", GPU_SAMPLES, ids=lambda p: p.name)
def test_vllms_own_parser_accepts_the_rendered_arguments(path):
    parser = vllm_serve_parser()
    args = server(render.render(with_runtime(yaml.safe_load(path.read_text()), "vllm")))["args"]
    parsed = parser.parse_args(args)
    assert parsed.model_tag == args[0]
    assert parsed.port == 8000 and parsed.tensor_parallel_size >= 1


def test_vllms_parser_has_the_shared_flags_and_lacks_the_kvfleet_only_ones():
    parser = vllm_serve_parser()
    options = {o for action in parser._actions for o in action.option_strings}
    rows = [f for f in runtime.FLAGS if f.value is None]
    assert {f.flag for f in rows if runtime.VLLM in f.runtimes} <= options
    assert not {f.flag for f in rows if runtime.VLLM not in f.runtimes} & options
