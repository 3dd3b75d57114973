"""Rendering the model cache: every mode and source, the credentials' one destination, valid Kubernetes objects."""
from __future__ import annotations

import itertools

import kubernetes_validate
import pytest

from kvfleet_operator import admission, api, cache, model_source, render
from kvfleet_operator.model_source import Pin

K8S_VERSIONS = ("1.30", "1.35")
MODES = {"emptyDir": {}, "emptyDir+sizeLimit": {"emptyDir": {"sizeLimit": "40Gi"}},
         "persistentVolumeClaim": {"persistentVolumeClaim": "weights"},
         "shared": {"shared": {"size": "100Gi", "storageClassName": "nfs"}}}
SOURCES = {
    "hf": {"model": {"uri": "hf://org/llama@v1.0"}},
    "hf-gguf": {"model": {"uri": "hf://bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_0.gguf"},
                "engine": {"quantization": "gguf"}},
    "s3": {"model": {"uri": "s3://models/llama/8b", "s3": {"endpointUrl": "http://minio.minio:9000",
                                                            "region": "eu-west-1", "addressingStyle": "path"}}},
    "hf+draft+tokenizer": {"model": {"uri": "hf://org/llama", "tokenizer": "s3://models/tok"},
                           "engine": {"speculative": {"method": "draft_model", "numSpeculativeTokens": 4,
                                                      "draftModel": "hf://org/llama-small"}}},
}
PINS = {"hf://org/llama@v1.0": Pin("a" * 40), "hf://org/llama": Pin("b" * 40), "hf://org/llama-small": Pin("c" * 40),
        "hf://bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_0.gguf": Pin("d" * 40),
        "s3://models/llama/8b": Pin("e" * 40), "s3://models/tok": Pin("f" * 40)}


def isvc(source: dict, cache_spec: dict, env: list | None = None) -> dict:
    spec = {**source, "modelCache": cache_spec}
    spec["model"] = {**source["model"], "credentialsSecret": "store-credentials"}
    spec["engine"] = {**source.get("engine", {}), "env": env or [{"name": "HF_HUB_OFFLINE", "value": "1"}]}
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": "m", "namespace": "ns", "uid": "u-1", "generation": 2}, "spec": spec}


def everything(obj: dict) -> list[dict]:
    """The children, the claim and the download Jobs, as the reconcile renders them (pinned)."""
    spec = render.parse_spec(obj)
    children = render.render(obj, pins=PINS, hf_endpoint="https://hub.example")
    owner = render.owner_reference(obj)
    dl = render.downloader(spec, render.ServingDefaults(), "https://hub.example")
    claim = cache.claim(obj, spec, owner)
    jobs = [cache.download_job(obj, spec, s, PINS[s.uri], dl, ["0" * 40], owner, render.pod_security_context())
            for s in cache.downloaded(spec)] if claim else []
    return [c for c in (children.deployment, children.service, children.pdb, claim) if c] + jobs


@pytest.mark.parametrize("source,mode", itertools.product(SOURCES, MODES))
def test_every_rendered_object_is_valid_kubernetes(source, mode):
    for doc in everything(isvc(SOURCES[source], MODES[mode])):
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("source,mode", itertools.product(SOURCES, MODES))
def test_only_the_downloader_gets_the_credentials(source, mode):
    docs = everything(isvc(SOURCES[source], MODES[mode]))
    dep = docs[0]
    pod = dep["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert "envFrom" not in server
    assert not {e["name"] for e in server["env"]} & set(api.CREDENTIAL_ENV)
    assert "store-credentials" not in str(server)
    downloaders = pod.get("initContainers", []) + [j["spec"]["template"]["spec"]["containers"][0]
                                                   for j in docs if j["kind"] == "Job"]
    assert downloaders and all(d["envFrom"] == [{"secretRef": {"name": "store-credentials"}}] for d in downloaders)
    assert all(d["command"] == ["kvfleet-download"] for d in downloaders)
    # the server only reads the cache; the downloads write it
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
    assert all({"name": "model-cache", "mountPath": "/models"} in d["volumeMounts"] for d in downloaders)


@pytest.mark.parametrize("name", api.CREDENTIAL_ENV)
def test_a_credential_in_engine_env_is_refused_naming_the_field(name):
    obj = isvc(SOURCES["hf"], {}, env=[{"name": name, "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
    with pytest.raises(render.Unrealisable) as err:
        render.render(obj)
    assert err.value.reason == "InvalidSpec"
    assert err.value.message.startswith(f"spec.engine.env: {name} is a credential: put it in the Secret named by "
                                        f"spec.model.credentialsSecret")
    assert any("spec.engine.env[]: a credential" in e for e in admission.validate(obj))  # and at admission (CEL)


def test_pinned_paths_and_downloader_arguments_per_source():
    dep = everything(isvc(SOURCES["hf+draft+tokenizer"], MODES["emptyDir"]))[0]
    pod = dep["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == f"/models/hf/org/llama/{'b' * 40}"
    assert args[args.index("--tokenizer") + 1] == f"/models/s3/models/tok/{'f' * 40}"
    assert f'"model":"/models/hf/org/llama-small/{"c" * 40}"' in args[args.index("--speculative-config") + 1]
    assert [i["args"] for i in pod["initContainers"]] == [
        ["hf", "org/llama", "--revision", "b" * 40, "--dest", f"/models/hf/org/llama/{'b' * 40}",
         "--endpoint", "https://hub.example", "--progress-port", "9400"],
        ["hf", "org/llama-small", "--revision", "c" * 40, "--dest", f"/models/hf/org/llama-small/{'c' * 40}",
         "--endpoint", "https://hub.example", "--progress-port", "9400"],
        ["s3", "models", "--dest", f"/models/s3/models/tok/{'f' * 40}", "--prefix", "tok", "--revision", "f" * 40,
         "--role", "tokenizer", "--progress-port", "9400"]]
    assert dep["metadata"]["annotations"][cache.REVISIONS_ANNOTATION] == \
        '{"hf://org/llama":"' + "b" * 40 + '","hf://org/llama-small":"' + "c" * 40 + '","s3://models/tok":"' + \
        "f" * 40 + '"}'

    s3 = everything(isvc(SOURCES["s3"], MODES["shared"]))
    job = next(d for d in s3 if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    assert job["args"] == ["s3", "models", "--dest", f"/models/s3/models/llama/8b/{'e' * 40}", "--prefix", "llama/8b",
                           "--revision", "e" * 40, "--endpoint-url", "http://minio.minio:9000", "--region",
                           "eu-west-1", "--addressing-style", "path", "--prune", "--keep", "0" * 40,
                           "--progress-port", "9400"]

    gguf = everything(isvc(SOURCES["hf-gguf"], MODES["shared"]))[0]["spec"]["template"]["spec"]["containers"][0]
    assert gguf["args"][gguf["args"].index("--model") + 1] == \
        f"/models/hf/bartowski/Llama-3.2-1B-Instruct-GGUF/{'d' * 40}/Llama-3.2-1B-Instruct-Q4_0.gguf"
    assert gguf["args"][gguf["args"].index("--served-model-name") + 1] == "bartowski/Llama-3.2-1B-Instruct-GGUF"


def test_an_emptydir_size_limit_is_requested_as_ephemeral_storage():
    for mode, expected in (("emptyDir", None), ("emptyDir+sizeLimit", "40Gi"), ("shared", None)):
        server = everything(isvc(SOURCES["hf"], MODES[mode]))[0]["spec"]["template"]["spec"]["containers"][0]
        assert (server.get("resources") or {}).get("requests", {}).get("ephemeral-storage") == expected, mode


def test_shared_cache_claim_and_job():
    docs = everything(isvc(SOURCES["hf"], {"shared": {"size": "100Gi", "accessMode": "ReadWriteOnce"}}))
    claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "m-model-cache"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}}}
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert len(job["metadata"]["name"]) <= 63 and job["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    tpl = job["spec"]["template"]
    assert tpl["spec"]["restartPolicy"] == "Never" and tpl["spec"]["automountServiceAccountToken"] is False
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "m-model-cache"}} in tpl["spec"]["volumes"]
    # never selected by the serving pods' Service or Deployment
    selector = render.selector_labels("m")
    assert any(tpl["metadata"]["labels"].get(k) != v for k, v in selector.items())
    assert job["spec"]["podFailurePolicy"]["rules"][0] == {
        "action": "FailJob", "onExitCodes": {"containerName": "model-download", "operator": "In", "values": [3]}}


@pytest.mark.parametrize("uri", ["hf://x", "hf://org/repo/file.bin", "s3://B/upper", "gs://bucket/x", "hf://o/r@"])
def test_a_malformed_uri_names_the_field_and_the_forms(uri):
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc({"model": {"uri": uri}}, {}))
    assert err.value.message.startswith(f"spec.model.uri: {uri!r} is not a model uri; expected hf://ORG/REPO")
    assert "pattern" not in err.value.message  # no regular expression dumped at the user


@pytest.mark.parametrize("spec,message", [
    ({"model": {"uri": "pvc://w/m", "credentialsSecret": "s"}}, "spec.model.credentialsSecret: nothing is downloaded"),
    ({"model": {"uri": "hf://o/r", "s3": {"region": "x"}}}, "spec.model.s3: no s3:// uri uses it"),
    ({"model": {"uri": "file:///m"}, "modelCache": {"shared": {"size": "1Gi"}}},
     "spec.modelCache.shared: nothing is downloaded"),
    ({"model": {"uri": "hf://o/r"}, "modelCache": {"emptyDir": {}, "shared": {"size": "1Gi"}}},
     "spec.modelCache: set one of persistentVolumeClaim, emptyDir or shared"),
])
def test_fields_that_would_be_ignored_are_refused(spec, message):
    with pytest.raises(render.Unrealisable) as err:
        render.render({"metadata": {"name": "m"}, "spec": spec})
    assert message in err.value.message


def test_uris_parse_to_what_is_downloaded():
    p = model_source.parse
    assert p("hf://o/r@refs/pr/3/sub/f.gguf", "f") == model_source.Source(
        "hf://o/r@refs/pr/3/sub/f.gguf", "f", "hf", "o/r", "refs/pr/3", file="sub/f.gguf")
    assert p("hf://o/r@feature/x", "f").ref == "feature/x"
    assert (p("s3://bkt/a/m.gguf", "f").prefix, p("s3://bkt/a/m.gguf", "f").file) == ("a", "m.gguf")
    assert not p("pvc://c/x", "f").downloaded and p("s3://bkt", "f").downloaded
