"""spec.adapters (LoRA): rendered as vLLM's flags with each adapter's path, downloaded and pinned like the model,
refused with the field named when the uri or a name cannot work, and counted per adapter in status.adapters
from the ready pods (KMock with the real kopf runtime; the pods are played by the test)."""
from __future__ import annotations

import pytest

from kmock_support import running_operator, wait_for
from kvfleet_operator import api as isvc_api
from kvfleet_operator import cache, pods, render
from kvfleet_operator.model_source import Pin

AV, PL = isvc_api.API_VERSION, isvc_api.PLURAL
ADAPTERS = [{"name": "sql", "uri": "hf://org/sql-lora@v2"}, {"name": "chat", "uri": "pvc://adapters/chat"},
            {"name": "legal", "uri": "s3://loras/legal"}]


def isvc(adapters=ADAPTERS, engine=None, model="hf://org/llama") -> dict:
    return {"apiVersion": AV, "kind": isvc_api.KIND, "metadata": {"name": "m", "namespace": "default", "uid": "u"},
            "spec": {"model": {"uri": model}, "adapters": adapters, "engine": engine or {},
                     "resources": {"gpus": 0, "cpu": "1"}}}


def server_args(obj: dict, pins=None) -> list[str]:
    return render.render(obj, pins=pins).deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_adapters_render_as_vllm_flags_with_their_downloaded_paths():
    pins = {"hf://org/llama": Pin("a" * 40), "hf://org/sql-lora@v2": Pin("b" * 40), "s3://loras/legal": Pin("c" * 40)}
    dep = render.render(isvc(), pins=pins).deployment
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    i = args.index("--lora-modules")
    assert args[i + 1:i + 4] == [f"sql=/models/hf/org/sql-lora/{'b' * 40}", "chat=/models/pvc/adapters/chat",
                                 f"legal=/models/s3/loras/legal/{'c' * 40}"]
    assert "--enable-lora" in args and args[args.index("--max-loras") + 1] == "3"
    assert args[args.index("--max-lora-rank") + 1] == "16"
    inits = dep["spec"]["template"]["spec"]["initContainers"]
    adapter_downloads = [c["args"] for c in inits if "--role" in c["args"]]
    assert [a[a.index("--role") + 1] for a in adapter_downloads] == ["adapter", "adapter"]
    assert dep["spec"]["template"]["metadata"]["annotations"][render.ADAPTERS_ANNOTATION] == "sql,chat,legal"
    assert [s.field for s in cache.sources(render.parse_spec(isvc())) if s.role == "adapter"] == \
        ["spec.adapters[0].uri", "spec.adapters[1].uri", "spec.adapters[2].uri"]
    none = server_args(isvc(adapters=[]))
    assert not {"--enable-lora", "--lora-modules", "--max-loras"} & set(none)
    engine = {"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 4}
    args = server_args(isvc(engine=engine))
    assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-cpu-loras") + 1] == "4"
    gpu = isvc(engine={"runtime": "vllm"})
    gpu["spec"]["resources"] = {"gpus": 1}
    vllm = server_args(gpu, pins)
    assert "--lora-modules" in vllm  # vLLM's own flags: the vllm runtime takes them as they are


@pytest.mark.parametrize("adapters, engine, message", [
    ([{"name": "x", "uri": "gs://bucket/x"}], None, "spec.adapters[0].uri: 'gs://bucket/x' is not a LoRA adapter uri"),
    ([{"name": "x", "uri": "bundled://smollm2"}], None, "spec.adapters[0].uri: 'bundled://smollm2' is not a LoRA"),
    ([{"name": "x", "uri": "hf://o/r/a.gguf"}], None, "is not a LoRA adapter uri"),
    ([{"name": "x", "uri": "hf://o/a"}, {"name": "x", "uri": "hf://o/b"}], None, "spec.adapters[1].name: 'x' is given twice"),
    ([{"name": "org/llama", "uri": "hf://o/a"}], None, "the name 'org/llama' is the base model's"),
    ([], {"maxLoras": 2}, "spec.engine.maxLoras: needs spec.adapters"),
    ([{"name": "x", "uri": "hf://o/a"}], {"maxLoras": 4, "maxCpuLoras": 2}, "spec.engine.maxCpuLoras (2) must be >="),
])
def test_adapters_that_cannot_work_are_refused_naming_the_field(adapters, engine, message):
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc(adapters, engine))
    assert message in err.value.message


def _pod(name: str, annotation: str | None, ready: bool = True, terminating: bool = False) -> dict:
    meta = {"name": name, "namespace": "default", "labels": render.common_labels("m"),
            "annotations": {render.ADAPTERS_ANNOTATION: annotation} if annotation is not None else {}}
    if terminating:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": render.SERVER_CONTAINER, "image": "kvfleet-server:cpu"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_adapter_counts_take_ready_live_pods_of_each_template():
    live = [_pod("a", "sql,chat"), _pod("b", "sql"), _pod("c", "sql,chat", ready=False),
            _pod("d", "sql,chat", terminating=True), _pod("e", None)]
    assert pods.adapter_counts(["sql", "chat", "legal"], live, render.ADAPTERS_ANNOTATION) == [
        {"name": "sql", "readyReplicas": 2}, {"name": "chat", "readyReplicas": 1}, {"name": "legal", "readyReplicas": 0}]


async def test_reconcile_renders_the_adapters_and_counts_ready_pods_per_adapter(api, emulator):
    obj = isvc([{"name": "sql", "uri": "pvc://adapters/sql"}, {"name": "chat", "uri": "file:///adapters/chat"}],
               model="file:///models/llama")
    obj["metadata"].pop("uid")
    async with running_operator():
        await api.create(AV, PL, "default", obj)
        dep = await wait_for(lambda: api.get("apps/v1", "deployments", "default", "m"))
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--lora-modules") + 1:][:2] == ["sql=/models/pvc/adapters/sql", "chat=/adapters/chat"]
        await api.create("v1", "pods", "default", _pod("m-1", "sql,chat"))
        await api.create("v1", "pods", "default", _pod("m-2", "sql"))  # an older template's pod
        # the Deployment controller counts them (its status change is what reconciles the owner)
        await api.patch("apps/v1", "deployments", "default", "m",
                        {"status": {"replicas": 2, "readyReplicas": 2, "availableReplicas": 2}}, subresource="status")

        async def counted(want):
            async def check():
                live = await api.get(AV, PL, "default", "m")
                return live if ((live or {}).get("status") or {}).get("adapters") == want else None
            return await wait_for(check)

        await counted([{"name": "sql", "readyReplicas": 2}, {"name": "chat", "readyReplicas": 1}])
        # an adapter removed from the spec: the Deployment's flags lose it, the status stops listing it
        await api.patch(AV, PL, "default", "m", {"spec": {"adapters": [{"name": "sql", "uri": "pvc://adapters/sql"}]}})

        async def rendered():
            d = await api.get("apps/v1", "deployments", "default", "m")
            a = d["spec"]["template"]["spec"]["containers"][0]["args"]
            return "chat=/adapters/chat" not in a and "sql=/models/pvc/adapters/sql" in a
        await wait_for(rendered)
        await counted([{"name": "sql", "readyReplicas": 2}])
        # every adapter removed: no LoRA flag, no status.adapters
        await api.patch(AV, PL, "default", "m", {"spec": {"adapters": None}})
        await counted(None)
        d = await api.get("apps/v1", "deployments", "default", "m")
        assert "--enable-lora" not in d["spec"]["template"]["spec"]["containers"][0]["args"]
