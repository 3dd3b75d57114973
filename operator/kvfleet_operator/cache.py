"""Pure: the model cache of an InferenceService — its volume, the downloads, the paths the server loads.

Three modes (``spec.modelCache``; docs/operator.md sizes them):

- ``emptyDir`` (the default): each pod downloads its own copy in an init container into a per-pod
  emptyDir; a ``sizeLimit`` is also requested as the server container's ``ephemeral-storage``, so the
  scheduler places the pod on a node with that much disk;
- ``persistentVolumeClaim``: a claim the user brings; each pod's init container fills it (a file
  already there is not fetched again; the huggingface_hub client locks files against concurrent pods);
- ``shared``: the operator creates the claim (``claim``), fills it with one download Job per source
  and pinned revision (``download_job``) and creates or moves the Deployment only once that Job has
  succeeded (``kvfleet_operator.weights``): nothing downloads twice, and pods never hold GPUs while
  waiting for weights. The Job prunes the source's other revisions except the one being served.

The serving container mounts the cache read-only in every mode and never gets the credentials:
``spec.model.credentialsSecret`` reaches the downloader alone (``envFrom``). Downloads run
``kvfleet-download`` (``kvfleet_server.download``) from the serving image, so no other image is
pulled and the Job warms the node's image cache for the server.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import api, model_source
from .model_source import MODEL_ROOT, Pin, Source

VOLUME = "model-cache"
DOWNLOAD_CONTAINER = "model-download"
DOWNLOAD_COMPONENT = "model-download"
PROGRESS_PORT = 9400
PROGRESS_PORT_NAME = "progress"
REVISIONS_ANNOTATION = "serving.kvfleet.dev/model-revisions"  # on the Deployment: {uri: revision} it serves
URI_ANNOTATION = "serving.kvfleet.dev/model-uri"
REVISION_ANNOTATION = "serving.kvfleet.dev/model-revision"
FIELD_ANNOTATION = "serving.kvfleet.dev/model-field"
GENERATION_ANNOTATION = "serving.kvfleet.dev/generation"
SOURCE_LABEL = "serving.kvfleet.dev/model-source"  # a hash of the uri (label values are short)
JOB_BACKOFF_LIMIT = 6  # network failures retried (10 s .. 6 min apart); exit status 3 fails at once
DOWNLOAD_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


def sources(spec: api.InferenceServiceSpec) -> list[Source]:
    """The model, draft model, tokenizer and LoRA adapter sources of ``spec`` (one per uri: a tokenizer uri
    equal to a model's is covered by the model's download)."""
    out: dict[str, Source] = {}
    sp = spec.engine.speculative
    for uri, fld, role in ((spec.model.uri, "spec.model.uri", "model"),
                           (sp.draft_model if sp else None, "spec.engine.speculative.draftModel", "model"),
                           (spec.model.tokenizer, "spec.model.tokenizer", "tokenizer"),
                           *((a.uri, f"spec.adapters[{i}].uri", "adapter") for i, a in enumerate(spec.adapters))):
        if uri and uri not in out:
            out[uri] = model_source.parse(uri, fld, role)
    return list(out.values())


def downloaded(spec: api.InferenceServiceSpec) -> list[Source]:
    """The sources that are fetched into the cache (hf://, s3://)."""
    return [s for s in sources(spec) if s.downloaded]


def s3_options(spec: api.InferenceServiceSpec) -> model_source.S3Options:
    s3 = spec.model.s3
    return model_source.S3Options(s3.endpoint_url, s3.region, s3.addressing_style) if s3 else model_source.S3Options()


def mode(spec: api.InferenceServiceSpec) -> str:
    """shared, persistentVolumeClaim or emptyDir."""
    cache = spec.model_cache
    return "shared" if cache.shared else "persistentVolumeClaim" if cache.persistent_volume_claim else "emptyDir"


def claim_name(name: str) -> str:
    """The operator-created claim of a shared cache."""
    return f"{name}-model-cache"


def job_name(name: str, source: Source, pin: Pin) -> str:
    """Download Job of ``source`` at ``pin``: at most 63 characters (the job-name label of its pods)."""
    digest = hashlib.sha256(f"{source.uri}\n{pin.revision}".encode()).hexdigest()[:10]
    return f"{name[:63 - 16]}-model-{digest}"


def source_label(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------- pods
@dataclass
class PodStorage:
    """What the serving pod needs for its models: ``volumes`` and the server's ``mounts``, the
    ``init_containers`` that download (per-pod modes), ``paths`` (uri -> path the server loads),
    ``ephemeral_storage`` to request (an emptyDir's sizeLimit) and ``revisions`` (uri -> pinned revision)."""
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    ephemeral_storage: str | None = None
    revisions: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Downloader:
    """How download containers run: image, pull policy, the server's env (engine.env), the Hub the
    operator resolved against, and the security context of the serving container."""
    image: str
    pull_policy: str
    env: list[dict[str, Any]]
    hf_endpoint: str | None
    security_context: dict[str, Any]


def _pin(pins: Mapping[str, Pin] | None, source: Source) -> Pin:
    return (pins or {}).get(source.uri) or model_source.unpinned(source)


def download_container(spec: api.InferenceServiceSpec, source: Source, pin: Pin, dl: Downloader,
                       keep: list[str] | None, name: str = DOWNLOAD_CONTAINER) -> dict[str, Any]:
    """The ``kvfleet-download`` container fetching ``source`` at ``pin`` into the cache volume (read-write)."""
    args = model_source.downloader_args(source, pin, s3_options(spec), dl.hf_endpoint, keep, PROGRESS_PORT)
    box: dict[str, Any] = {
        "name": name, "image": dl.image, "imagePullPolicy": dl.pull_policy,
        "command": ["kvfleet-download"], "args": args, "env": dl.env,
        "ports": [{"name": PROGRESS_PORT_NAME, "containerPort": PROGRESS_PORT, "protocol": "TCP"}],
        "resources": DOWNLOAD_RESOURCES,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": VOLUME, "mountPath": MODEL_ROOT}],
        "securityContext": dl.security_context,
        "terminationMessagePolicy": "FallbackToLogsOnError",  # its last line: "error: REASON: MESSAGE"
    }
    if spec.model.credentials_secret:
        box["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret}}]
    return box


def pod_storage(obj: dict[str, Any], spec: api.InferenceServiceSpec, pins: Mapping[str, Pin] | None,
                dl: Downloader) -> PodStorage:
    """Volumes, mounts, init containers and model paths of the serving pod, for ``pins`` (uri -> Pin;
    a downloaded source without one is rendered unpinned, ``model_source.unpinned``)."""
    out = PodStorage()
    down = [s for s in sources(spec) if s.downloaded]
    cache = spec.model_cache
    if down:
        if cache.shared:
            out.volumes.append({"name": VOLUME, "persistentVolumeClaim": {
                "claimName": claim_name(obj["metadata"]["name"]), "readOnly": True}})
        elif cache.persistent_volume_claim:
            out.volumes.append({"name": VOLUME, "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim}})
        else:
            empty: dict[str, Any] = {}
            if cache.empty_dir is not None and cache.empty_dir.size_limit is not None:
                empty["sizeLimit"] = out.ephemeral_storage = str(cache.empty_dir.size_limit)
            out.volumes.append({"name": VOLUME, "emptyDir": empty})
        out.mounts.append({"name": VOLUME, "mountPath": MODEL_ROOT, "readOnly": True})
    for i, source in enumerate(down):
        pin = _pin(pins, source)
        out.paths[source.uri] = model_source.served_path(source, pin)
        out.revisions[source.uri] = pin.revision
        if not cache.shared:
            out.init_containers.append(download_container(
                spec, source, pin, dl, None, f"{DOWNLOAD_CONTAINER}-{i}" if i else DOWNLOAD_CONTAINER))
    for source in sources(spec):
        if source.store == "pvc":
            vol = f"pvc-{source.name}"  # a volume name is a DNS-1123 label: long claim names get a hash
            vol = vol if len(vol) <= 63 else f"pvc-{hashlib.sha256(source.name.encode()).hexdigest()[:20]}"
            mount = f"{MODEL_ROOT}/pvc/{source.name}"
            if all(v["name"] != vol for v in out.volumes):
                out.volumes.append({"name": vol, "persistentVolumeClaim": {"claimName": source.name, "readOnly": True}})
                out.mounts.append({"name": vol, "mountPath": mount, "readOnly": True})
            out.paths[source.uri] = f"{mount}/{source.prefix}" if source.prefix else mount
        elif source.store in ("file", "bundled"):
            out.paths[source.uri] = source.prefix if source.store == "file" else source.name
    return out


def revisions_annotation(storage: PodStorage) -> dict[str, str]:
    """The Deployment's annotation recording the revision of each downloaded source it serves."""
    if not storage.revisions:
        return {}
    return {REVISIONS_ANNOTATION: json.dumps(storage.revisions, sort_keys=True, separators=(",", ":"))}


def served_revisions(deployment: dict[str, Any] | None) -> dict[str, str]:
    """uri -> revision the live Deployment serves ({} when absent or unannotated)."""
    notes = ((deployment or {}).get("metadata") or {}).get("annotations") or {}
    try:
        value = json.loads(notes.get(REVISIONS_ANNOTATION) or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------------- shared cache
def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvfleet-model-cache", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": DOWNLOAD_COMPONENT, "app.kubernetes.io/part-of": "kvfleet",
            "app.kubernetes.io/managed-by": "kvfleet-operator", "serving.kvfleet.dev/inferenceservice": name}


def download_selector(name: str) -> str:
    """Label selector of an InferenceService's download Jobs, their pods and its claim."""
    return f"serving.kvfleet.dev/inferenceservice={name},app.kubernetes.io/component={DOWNLOAD_COMPONENT}"


def _meta(obj: dict[str, Any], name: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": obj["metadata"].get("namespace") or "default",
                            "labels": _labels(obj["metadata"]["name"])}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def claim(obj: dict[str, Any], spec: api.InferenceServiceSpec, owner: dict[str, Any] | None) -> dict[str, Any] | None:
    """The PersistentVolumeClaim of a shared cache (None in the other modes). Owned by the
    InferenceService: deleted with it (docs/operator.md, the cache's deletion policy)."""
    shared = spec.model_cache.shared
    if shared is None:
        return None
    pvc_spec: dict[str, Any] = {"accessModes": [shared.access_mode],
                                "resources": {"requests": {"storage": str(shared.size)}}}
    if shared.storage_class_name:
        pvc_spec["storageClassName"] = shared.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(obj, claim_name(obj["metadata"]["name"]), owner), "spec": pvc_spec}


def download_job(obj: dict[str, Any], spec: api.InferenceServiceSpec, source: Source, pin: Pin, dl: Downloader,
                 keep: list[str], owner: dict[str, Any] | None, pod_security: dict[str, Any]) -> dict[str, Any]:
    """The Job filling the shared claim with ``source`` at ``pin`` (pruning its other revisions but
    ``keep``). A download error retrying cannot fix (exit status 3) fails the Job at once; other
    failures are retried ``JOB_BACKOFF_LIMIT`` times; an evicted pod does not count."""
    name = obj["metadata"]["name"]
    meta = _meta(obj, job_name(name, source, pin), owner)
    meta["labels"][SOURCE_LABEL] = source_label(source.uri)
    meta["annotations"] = {URI_ANNOTATION: source.uri, REVISION_ANNOTATION: pin.revision,
                           FIELD_ANNOTATION: source.field,
                           GENERATION_ANNOTATION: str((obj["metadata"].get("generation") or 0))}
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "containers": [download_container(spec, source, pin, dl, keep)],
        "volumes": [{"name": "tmp", "emptyDir": {}},
                    {"name": VOLUME, "persistentVolumeClaim": {"claimName": claim_name(name)}}],
    }
    if spec.service_account_name:  # e.g. a workload identity that may read the bucket
        pod["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": r.name} for r in spec.image_pull_secrets]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {
        "backoffLimit": JOB_BACKOFF_LIMIT,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": DOWNLOAD_CONTAINER, "operator": "In",
                                                  "values": [3]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
        "template": {"metadata": {"labels": {**meta["labels"], "serving.kvfleet.dev/download-job": meta["name"]}},
                     "spec": pod}}}
