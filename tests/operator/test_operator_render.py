"""Unit tests of the pure render: every spec field lands as the right flag, resource, volume or probe."""
from __future__ import annotations

import json

import pytest

from kvfleet_operator import render


def isvc(spec: dict, name: str = "m", status: dict | None = None) -> dict:
    obj = {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": name, "namespace": "ns", "uid": "u-1", "generation": 3}, "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def container(children: render.Children) -> dict:
    return children.deployment["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


HF = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}}


def test_defaults_for_omitted_fields():
    c = render.render(isvc(HF))
    box, args = container(c), container(c)["args"]
    assert box["command"] == ["kvfleet-server"]
    assert flag(args, "--model") == "/models/hf/meta-llama/Llama-3.1-8B-Instruct/main"
    assert flag(args, "--served-model-name") == "meta-llama/Llama-3.1-8B-Instruct"
    assert flag(args, "--port") == "8000" and flag(args, "--device") == "cuda" and flag(args, "--dtype") == "auto"
    assert flag(args, "--block-size") == "16" and flag(args, "--gpu-memory-utilization") == "0.9"
    assert "--enable-prefix-caching" in args and "--quantization" not in args
    assert flag(args, "--kv-cache-dtype") == "auto" and flag(args, "--tensor-parallel-size") == "1"
    assert flag(args, "--shutdown-timeout") == "30"
    for absent in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--speculative-config",
                   "--tokenizer"):
        assert absent not in args
    # per GPU: 4 CPUs and 24Gi requested (ServingDefaults), no memory limit by default
    assert box["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "4", "memory": "24Gi"}}
    assert c.deployment["spec"]["replicas"] == 1 and c.pdb is None
    assert box["image"].startswith("ghcr.io/kvfleet/kvfleet-server:")
    assert c.service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
                                           "appProtocol": "http"}]
    assert c.service["spec"]["type"] == "ClusterIP"
    volumes = {v["name"] for v in c.deployment["spec"]["template"]["spec"]["volumes"]}
    assert "dshm" not in volumes and "model-cache" in volumes


@pytest.mark.usefixtures("features_landed")
def test_every_engine_field_becomes_a_flag():
    spec = {**HF, "model": {**HF["model"], "name": "llama", "tokenizer": "file:///tok"},
            "engine": {"image": "img:1", "imagePullPolicy": "Always", "dtype": "bfloat16", "quantization": "fp8",
                       "kvCacheDtype": "fp8", "tensorParallelSize": 2, "gpuMemoryUtilization": 0.85,
                       "maxModelLen": 8192, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096, "blockSize": 32,
                       "enablePrefixCaching": False, "shutdownTimeoutSeconds": 60,
                       "speculative": {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMin": 2,
                                       "promptLookupMax": 5},
                       "extraArgs": ["--max-queue-len", "64"],
                       "env": [{"name": "A", "value": "1"},
                               {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}}]}}
    c = render.render(isvc(spec))
    box = container(c)
    args = box["args"]
    assert box["image"] == "img:1" and box["imagePullPolicy"] == "Always"
    assert flag(args, "--served-model-name") == "llama" and flag(args, "--tokenizer") == "/tok"
    assert flag(args, "--dtype") == "bfloat16" and flag(args, "--quantization") == "fp8"
    assert flag(args, "--kv-cache-dtype") == "fp8" and flag(args, "--tensor-parallel-size") == "2"
    assert flag(args, "--gpu-memory-utilization") == "0.85" and flag(args, "--max-model-len") == "8192"
    assert flag(args, "--max-num-seqs") == "64" and flag(args, "--max-num-batched-tokens") == "4096"
    assert flag(args, "--block-size") == "32" and "--no-enable-prefix-caching" in args
    assert "--enable-prefix-caching" not in args
    assert flag(args, "--shutdown-timeout") == "60"
    assert json.loads(flag(args, "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert args[-2:] == ["--max-queue-len", "64"]  # extraArgs appended last
    env = {e["name"]: e for e in box["env"]}
    assert env["A"]["value"] == "1" and env["B"]["valueFrom"]["secretKeyRef"] == {"name": "s", "key": "t"}
    pod = c.deployment["spec"]["template"]["spec"]
    # the grace period runs from the preStop sleep on: sleep + drain + margin, so the drain is never cut short
    assert pod["terminationGracePeriodSeconds"] == render.PRESTOP_SLEEP_SECONDS + 60 + render.TERMINATION_MARGIN_SECONDS
    assert render.TERMINATION_MARGIN_SECONDS > 0
    assert box["lifecycle"]["preStop"]["sleep"]["seconds"] == render.PRESTOP_SLEEP_SECONDS


def test_draft_model_is_downloaded_and_passed():
    spec = {**HF, "engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 5,
                                             "draftModel": "hf://meta-llama/Llama-3.2-1B-Instruct",
                                             "disableByBatchSize": 16}}}
    c = render.render(isvc(spec))
    cfg = json.loads(flag(container(c)["args"], "--speculative-config"))
    assert cfg == {"method": "draft_model", "num_speculative_tokens": 5, "disable_by_batch_size": 16,
                   "model": "/models/hf/meta-llama/Llama-3.2-1B-Instruct/main"}
    inits = c.deployment["spec"]["template"]["spec"]["initContainers"]
    assert [i["command"] for i in inits] == [["kvfleet-download"]] * 2
    assert [i["args"][:6] for i in inits] == [
        ["hf", "meta-llama/Llama-3.1-8B-Instruct", "--revision", "main", "--dest",
         "/models/hf/meta-llama/Llama-3.1-8B-Instruct/main"],
        ["hf", "meta-llama/Llama-3.2-1B-Instruct", "--revision", "main", "--dest",
         "/models/hf/meta-llama/Llama-3.2-1B-Instruct/main"]]


def test_layer_skip_renders_exactly_the_server_json():
    spec = {**HF, "engine": {"speculative": {"method": "layer_skip", "numSpeculativeTokens": 3, "numDraftLayers": 12}}}
    cfg = json.loads(flag(container(render.render(isvc(spec)))["args"], "--speculative-config"))
    assert cfg == {"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 12}
    from kvfleet_server.spec_decode_config import SpeculativeConfig

    assert SpeculativeConfig.from_dict(cfg).num_draft_layers == 12  # the server accepts what is rendered


def test_speculation_with_tensor_parallelism_renders_a_config_the_server_runs():
    from kvfleet_server.flags import build_parser, engine_config

    spec = {**HF, "engine": {"tensorParallelSize": 2,
                             "speculative": {"method": "layer_skip", "numSpeculativeTokens": 3, "numDraftLayers": 12}}}
    cfg = engine_config(build_parser().parse_args(container(render.render(isvc(spec)))["args"]))
    assert cfg.tensor_parallel_size == 2 and cfg.speculative_config["method"] == "layer_skip"
    cfg.validate()  # no refusal left for the combination


def test_crd_methods_follow_the_server():
    from kvfleet_server import spec_decode_config as server

    from kvfleet_operator import api

    assert api.SPECULATIVE_METHODS == server.SUPPORTED_METHODS
    assert set(api.UNSUPPORTED_SPECULATIVE_METHODS) <= set(server.UNSUPPORTED_METHODS)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "mtp"])
def test_unbuilt_speculative_method_refused_at_render(method):
    spec = {**HF, "engine": {"speculative": {"method": method, "numSpeculativeTokens": 5,
                                             "draftModel": "hf://yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}}}
    with pytest.raises(render.Unrealisable) as e:
        render.render(isvc(spec))
    assert e.value.reason == "InvalidSpec"
    assert f"spec.engine.speculative.method: not supported yet: --speculative-config method {method!r}" \
        in e.value.message


def test_tp4_gets_four_gpus_and_shared_memory():
    c = render.render(isvc({**HF, "engine": {"tensorParallelSize": 4}}))
    box, pod = container(c), c.deployment["spec"]["template"]["spec"]
    assert box["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # /dev/shm: 1Gi per tensor-parallel rank, memory-backed, with a size limit ...
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in box["volumeMounts"]
    # ... counted in the memory request (4 x 24Gi + 4Gi), as Kubernetes counts it against the container's memory
    assert box["resources"]["requests"] == {"cpu": "16", "memory": "100Gi"}
    assert "memory" not in box["resources"]["limits"]


AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}}


def test_resources_and_scheduling():
    spec = {**HF, "resources": {"gpus": 2, "gpuResourceName": "amd.com/gpu", "cpu": 8, "memory": "64Gi"},
            "scheduling": {"nodeSelector": {"pool": "gpu"}, "priorityClassName": "high", "runtimeClassName": "nvidia",
                           "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                           "affinity": AFFINITY}}
    c = render.render(isvc(spec))
    box, pod = container(c), c.deployment["spec"]["template"]["spec"]
    assert box["resources"] == {"limits": {"amd.com/gpu": "2", "memory": "64Gi"},
                                "requests": {"cpu": "8", "memory": "64Gi"}}
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["priorityClassName"] == "high"
    assert pod["runtimeClassName"] == "nvidia" and pod["affinity"] == AFFINITY
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_cpu_only_replica():
    c = render.render(isvc({"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0}}))
    args = container(c)["args"]
    assert flag(args, "--model") == "smollm2" and flag(args, "--device") == "cpu"
    assert "--gpu-memory-utilization" not in args
    assert "limits" not in container(c)["resources"]
    assert "initContainers" not in c.deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("timeout", [1800, 300, 10, 1805, 1801, 3600, 86400, 17])
def test_startup_probe_arithmetic(timeout):
    c = render.render(isvc({**HF, "probes": {"startupTimeoutSeconds": timeout}}))
    probe = container(c)["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == timeout
    assert 1 <= probe["periodSeconds"] <= 10
    assert probe["httpGet"] == {"path": "/health", "port": "http"}
    assert c.deployment["spec"]["progressDeadlineSeconds"] > timeout


def test_default_startup_probe_and_health_probes():
    box = container(render.render(isvc(HF)))
    assert (box["startupProbe"]["periodSeconds"], box["startupProbe"]["failureThreshold"]) == (10, 180)
    for probe in ("readinessProbe", "livenessProbe"):
        assert box[probe]["httpGet"] == {"path": "/health", "port": "http"}
    live, ready = box["livenessProbe"], box["readinessProbe"]
    # a restart only after a minute of failed /health (a long engine step must not kill a busy pod) ...
    assert live["periodSeconds"] * live["failureThreshold"] >= 60 and live["timeoutSeconds"] >= 5
    # ... while traffic stops within ~10 s of /health turning 503 (drain, engine failure)
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 10


def test_model_volumes_per_scheme():
    c = render.render(isvc({"model": {"uri": "pvc://weights/llama/8b"}}))
    pod = c.deployment["spec"]["template"]["spec"]
    assert flag(container(c)["args"], "--model") == "/models/pvc/weights/llama/8b"
    assert {"name": "pvc-weights", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "pvc-weights", "mountPath": "/models/pvc/weights", "readOnly": True} in container(c)["volumeMounts"]
    assert flag(container(c)["args"], "--served-model-name") == "8b"

    c = render.render(isvc({"model": {"uri": "file:///opt/models/qwen"}}))
    assert flag(container(c)["args"], "--model") == "/opt/models/qwen"
    assert {v["name"] for v in c.deployment["spec"]["template"]["spec"]["volumes"]} == {"tmp"}

    c = render.render(isvc({**HF, "modelCache": {"persistentVolumeClaim": "cache"}}))
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "cache"}} in \
        c.deployment["spec"]["template"]["spec"]["volumes"]
    c = render.render(isvc({**HF, "modelCache": {"emptyDir": {"sizeLimit": "40Gi"}}}))
    assert {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}} in \
        c.deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "HF_HOME", "value": "/tmp/.hf-home"} in container(c)["env"]  # not on the read-only cache
    assert container(c)["resources"]["requests"]["ephemeral-storage"] == "40Gi"  # the scheduler sees the disk
    # every mode: the server reads the cache, never writes it
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in container(c)["volumeMounts"]


def test_pod_security_labels_annotations_strategy_owner():
    c = render.render(isvc(HF, name="chat"))
    pod_t = c.deployment["spec"]["template"]
    pod, box = pod_t["spec"], container(c)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"  # no chown of a 100 GB cache per start
    assert box["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                      "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert {"name": "tmp", "mountPath": "/tmp"} in box["volumeMounts"]  # writable /tmp (HOME) on a read-only root
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    for init in pod["initContainers"]:  # the hf download runs as restricted as the server
        assert init["securityContext"] == box["securityContext"]
    assert pod_t["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                                                "prometheus.io/path": "/metrics"}
    assert c.deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    for child in (c.deployment, c.service):
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "chat"
        assert labels["app.kubernetes.io/managed-by"] == "kvfleet-operator"
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService", "name": "chat", "uid": "u-1",
            "controller": True, "blockOwnerDeletion": True}]
    assert c.deployment["spec"]["selector"]["matchLabels"].items() <= pod_t["metadata"]["labels"].items()
    assert c.service["spec"]["selector"] == c.deployment["spec"]["selector"]["matchLabels"]
    assert render.selector_string("chat") == "app.kubernetes.io/instance=chat,app.kubernetes.io/name=kvfleet-server"


def test_replicas_and_pdb():
    c = render.render(isvc({**HF, "replicas": 3}))
    assert c.deployment["spec"]["replicas"] == 3
    assert c.pdb["spec"] == {"maxUnavailable": 1, "selector": c.deployment["spec"]["selector"],
                             "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    auto = {**HF, "replicas": 7, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}
    assert render.render(isvc(auto)).deployment["spec"]["replicas"] == 2  # minReplicas, spec.replicas ignored
    assert render.render(isvc(auto, status={"desiredReplicas": 4})).deployment["spec"]["replicas"] == 4
    assert render.render(isvc(auto, status={"desiredReplicas": 9})).deployment["spec"]["replicas"] == 5
    spec = render.parse_spec(isvc(auto))
    assert render.desired_replicas(spec, live_replicas=3, status_desired=4) == 3  # the live count wins
    assert render.desired_replicas(spec, live_replicas=1, status_desired=None) == 2


@pytest.mark.parametrize("spec", [{**HF, "replicas": 3}, {**HF, "replicas": 1},
                                  {**HF, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}},
                                  {**HF, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 1}}],
                         ids=["fixed-3", "fixed-1", "autoscaled-1-4", "autoscaled-1-1"])
def test_scaling_a_rendering_equals_rendering_at_that_count(spec):
    """The reconcile renders once before reading the live Deployment, then scales with with_replicas."""
    obj = isvc(spec, status={"desiredReplicas": 2})
    parsed = render.parse_spec(obj)
    base = render.render(obj)
    for live in (None, 1, 2, 3, 7):
        replicas = render.desired_replicas(parsed, live if parsed.autoscaling.enabled else None, 2)
        assert render.with_replicas(base, replicas) == render.render(obj, replicas)
    assert base == render.render(obj)  # with_replicas copies


def test_invalid_spec_names_the_field():
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc({**HF, "engine": {"gpuMemoryUtilization": 1.5}}))
    assert err.value.reason == "InvalidSpec" and "spec.engine.gpuMemoryUtilization" in err.value.message


@pytest.mark.parametrize("sample", sorted((__import__("pathlib").Path(__file__).resolve().parents[2]
                                           / "crds" / "samples").glob("*.yaml")), ids=lambda p: p.name)
def test_rendered_args_parse_with_kvfleet_server(sample, monkeypatch):
    """Contract with the serving image: every rendered flag is one kvfleet-server's parser accepts. A sample
    marked "# Not runnable yet:" is refused by render today (Degraded UnsupportedFeature), and its flags
    parse once the features land."""
    import yaml

    from kvfleet_server import unsupported
    from kvfleet_server.flags import build_parser

    obj = yaml.safe_load(sample.read_text())
    marked = sample.read_text().startswith("# Not runnable yet:")
    if marked:
        with pytest.raises(render.Unrealisable) as err:
            render.render(obj)
        assert err.value.reason == "UnsupportedFeature" and "not supported yet" in err.value.message
        monkeypatch.setattr(unsupported, "ENGINE_REFUSALS", ())
    box = container(render.render(obj))
    assert box["command"] == ["kvfleet-server"]
    args = build_parser().parse_args(box["args"])
    spec = render.parse_spec(obj)
    assert args.port == spec.service.port and args.tensor_parallel_size == spec.engine.tensor_parallel_size
    assert args.enable_prefix_caching is spec.engine.enable_prefix_caching
    assert args.shutdown_timeout == spec.engine.shutdown_timeout_seconds


def test_cpu_sample_is_a_config_the_server_runs():
    """The kind sample must start: kvfleet-server builds its EngineConfig from the rendered flags."""
    import yaml

    from kvfleet_server.flags import build_parser, engine_config

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    obj = yaml.safe_load((root / "crds" / "samples" / "smollm2-135m-cpu.yaml").read_text())
    cfg = engine_config(build_parser().parse_args(container(render.render(obj))["args"]))
    assert (cfg.model, cfg.device, cfg.served_model_name, cfg.max_model_len) == ("smollm2", "cpu", "smollm2", 2048)


def test_service_port_and_type_reach_server_probes_and_service():
    c = render.render(isvc({**HF, "service": {"port": 9001, "type": "LoadBalancer"}}))
    box = container(c)
    assert flag(box["args"], "--port") == "9001"
    assert box["ports"] == [{"name": "http", "containerPort": 9001, "protocol": "TCP"}]
    assert box["startupProbe"]["httpGet"]["port"] == "http"  # probes follow the named port
    assert c.service["spec"]["type"] == "LoadBalancer"
    assert c.service["spec"]["ports"][0]["port"] == 9001 and c.service["spec"]["ports"][0]["targetPort"] == "http"
    assert c.deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9001"


@pytest.mark.parametrize("tp,shm", [(1, False), (2, True), (8, True)])
def test_shared_memory_from_tp_2_and_gpus_default_to_tp(tp, shm):
    c = render.render(isvc({**HF, "engine": {"tensorParallelSize": tp}}))
    names = {v["name"] for v in c.deployment["spec"]["template"]["spec"]["volumes"]}
    assert ("dshm" in names) is shm
    assert container(c)["resources"]["limits"]["nvidia.com/gpu"] == str(tp)


def test_hf_revision_and_pvc_without_path():
    c = render.render(isvc({"model": {"uri": "hf://Qwen/Qwen2-0.5B@refs/pr/7"}}))
    assert flag(container(c)["args"], "--model") == "/models/hf/Qwen/Qwen2-0.5B/refs/pr/7"
    assert flag(container(c)["args"], "--served-model-name") == "Qwen/Qwen2-0.5B"  # no revision in the name
    init = c.deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"][:6] == ["hf", "Qwen/Qwen2-0.5B", "--revision", "refs/pr/7", "--dest",
                                "/models/hf/Qwen/Qwen2-0.5B/refs/pr/7"]

    c = render.render(isvc({"model": {"uri": "pvc://weights"}}))
    assert flag(container(c)["args"], "--model") == "/models/pvc/weights"
    assert flag(container(c)["args"], "--served-model-name") == "weights"


@pytest.mark.usefixtures("features_landed")
def test_long_pvc_claims_get_distinct_valid_volume_names():
    a, b = "c" * 70 + "-model", "c" * 70 + "-draft"
    c = render.render(isvc({"model": {"uri": f"pvc://{a}/m"},
                            "engine": {"speculative": {"method": "draft", "numSpeculativeTokens": 2, "draftModel": f"pvc://{b}/d"}}}))
    vols = [v for v in c.deployment["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert [v["persistentVolumeClaim"]["claimName"] for v in vols] == [a, b]
    assert len({v["name"] for v in vols}) == 2 and all(len(v["name"]) <= 63 for v in vols)
    mounts = {m["name"] for m in container(c)["volumeMounts"]}
    assert {v["name"] for v in vols} <= mounts


@pytest.mark.usefixtures("features_landed")
def test_every_rendered_flag_is_protected_from_extra_args():
    """extraArgs may not override what a spec field renders (the last flag would win: --port would move
    the server away from its probes and Service)."""
    from kvfleet_operator import api

    spec = {"model": {"uri": "hf://a/b", "tokenizer": "file:///t"},
            "engine": {"quantization": "fp8", "maxModelLen": 64, "maxNumSeqs": 2, "maxNumBatchedTokens": 64,
                       "speculative": {"method": "ngram", "numSpeculativeTokens": 2}}}
    rendered = {a for a in container(render.render(isvc(spec)))["args"] if a.startswith("--")}
    assert rendered <= set(api.RENDERED_FLAGS)
    for arg in (["--port", "9000"], ["--port=9000"], ["--tensor-parallel"], ["--no-enable-prefix-caching"]):
        with pytest.raises(render.Unrealisable) as err:
            render.render(isvc({**HF, "engine": {"extraArgs": arg}}))
        assert err.value.reason == "InvalidSpec" and err.value.message.startswith("spec.engine.extraArgs: ")
    ok = render.render(isvc({**HF, "engine": {"extraArgs": ["--max-queue-len", "8", "--seed=1"]}}))
    assert container(ok)["args"][-3:] == ["--max-queue-len", "8", "--seed=1"]


@pytest.mark.parametrize("env,message", [
    ([{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
     "spec.engine.env[A]: set value or valueFrom, not both"),
    ([{"name": "A", "valueFrom": {}}], "set exactly one of secretKeyRef or configMapKeyRef"),
    ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "spec.engine.env: duplicate names ['A']"),
])
def test_env_the_api_server_would_refuse_in_the_deployment_is_refused(env, message):
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc({**HF, "engine": {"env": env}}))
    assert message in err.value.message


def test_user_env_overrides_home_and_hf_home():
    box = container(render.render(isvc({**HF, "engine": {"env": [{"name": "HF_HOME", "value": "/x"}]}})))
    assert [e for e in box["env"] if e["name"] == "HF_HOME"] == [{"name": "HF_HOME", "value": "/x"}]
    assert {"name": "HOME", "value": "/tmp"} in box["env"]


def test_serving_image_comes_from_the_operator_unless_the_spec_pins_one():
    # the CRD writes no default image into objects: an operator upgrade (chart servingImage) moves them all
    from kvfleet_operator import crdgen

    engine_schema = crdgen.openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert "default" not in engine_schema["image"] and "default" not in engine_schema["imagePullPolicy"]
    defaults = render.ServingDefaults("registry.example/kvfleet-server:0.2.0", "Always")
    box = container(render.render(isvc(HF), defaults=defaults))
    assert (box["image"], box["imagePullPolicy"]) == ("registry.example/kvfleet-server:0.2.0", "Always")
    init = render.render(isvc(HF), defaults=defaults).deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert init["image"] == "registry.example/kvfleet-server:0.2.0"
    pinned = container(render.render(isvc({**HF, "engine": {"image": "mine:1", "imagePullPolicy": "Never"}}),
                                     defaults=defaults))
    assert (pinned["image"], pinned["imagePullPolicy"]) == ("mine:1", "Never")
    assert render.ServingDefaults.from_env({}) == render.ServingDefaults()
    assert render.ServingDefaults.from_env({"KVFLEET_SERVING_IMAGE": "x:1"}).image == "x:1"


def test_pull_secrets_and_service_account_reach_the_pods():
    pod = render.render(isvc({**HF, "imagePullSecrets": [{"name": "regcred"}], "serviceAccountName": "llm-reader"})
                        ).deployment["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["serviceAccountName"] == "llm-reader"
    assert pod["automountServiceAccountToken"] is False
    plain = render.render(isvc(HF)).deployment["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in plain and "serviceAccountName" not in plain


@pytest.mark.parametrize("quantization, kv", [("int4", "fp8_e5m2"), ("int8", "fp8_e4m3"), ("gguf", "auto"),
                                              ("fp8", "fp8")])
def test_quantization_fields_render_flags_the_server_accepts(quantization, kv):
    """engine.quantization / engine.kvCacheDtype: every enum value renders a flag kvfleet-server's
    EngineConfig accepts (no refusal)."""
    from kvfleet_server.flags import build_parser, engine_config

    model = {"uri": "bundled://smollm2"} if quantization == "gguf" else HF["model"]
    args = container(render.render(isvc({"model": model, "engine": {"quantization": quantization,
                                                                     "kvCacheDtype": kv}})))["args"]
    assert flag(args, "--quantization") == quantization and flag(args, "--kv-cache-dtype") == kv
    cfg = engine_config(build_parser().parse_args(args))
    assert (cfg.quantization, cfg.kv_cache_dtype) == (quantization, kv)


def test_enums_match_what_the_server_supports():
    from typing import get_args

    from kvfleet_operator.api import EngineConfig as EngineSpec
    from kvfleet_server.config import KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES

    fields = EngineSpec.model_fields
    assert set(get_args(fields["quantization"].annotation)) == {"none", *QUANTIZATION_CHOICES}
    assert set(get_args(fields["kv_cache_dtype"].annotation)) == set(KV_CACHE_DTYPE_CHOICES)


def test_fp8_sample_quantization_flags_are_accepted():
    """The 70B FP8 TP4 sample renders --quantization fp8 --kv-cache-dtype fp8 --tensor-parallel-size 4 and
    render's own server check (parse_flags + EngineConfig) accepts them, with no refusal list emptied."""
    import pathlib

    import yaml

    root = pathlib.Path(__file__).resolve().parents[2]
    obj = yaml.safe_load((root / "crds" / "samples" / "llama-3.3-70b-instruct-fp8-tp4.yaml").read_text())
    args = container(render.render(obj))["args"]
    assert flag(args, "--quantization") == "fp8" and flag(args, "--kv-cache-dtype") == "fp8"
    assert flag(args, "--tensor-parallel-size") == "4"


def test_gguf_quantization_of_a_non_gguf_model_is_an_invalid_spec():
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc({**HF, "engine": {"quantization": "gguf"}}))
    assert err.value.reason == "InvalidSpec" and "spec.engine.quantization gguf needs a .gguf" in err.value.message
