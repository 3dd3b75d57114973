"""InferenceService API (serving.kvfleet.dev/v1alpha1): the single source of truth.

The pydantic models below define the custom resource's spec and status. ``crdgen`` turns them
into the CRD's structural OpenAPI v3 schema (descriptions, defaults, bounds, enums) and adds the
CEL rules listed in ``SPEC_RULES`` etc.; the same cross-field rules are enforced by the models'
validators, so code that parses a spec (the reconcile, ``kvfleet-operator render``) refuses the
objects the API server would refuse. Field names are camelCase in YAML (aliases), snake_case in
Python.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import model_source

GROUP = "serving.kvfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["infsvc"]
DEFAULT_IMAGE = "ghcr.io/kvfleet/kvfleet-server:0.1.0"  # the operator's fallback (chart: servingImage)
DEFAULT_PULL_POLICY = "IfNotPresent"
MODEL_URI_PATTERN = r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?(/[^\s@]+\.gguf)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?|file:///[^\s]+|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?|bundled://smollm2)$"
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
DNS1035 = r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
#: variables that carry credentials: they belong in the Secret of spec.model.credentialsSecret (the downloader's
#: environment), never in spec.engine.env (the serving container's)
CREDENTIAL_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                  "AWS_SESSION_TOKEN")
# Server flags the operator renders from spec fields (flag -> field; the table of runtime.py). extraArgs may
# not repeat them (the last occurrence would win: e.g. --port would move the server away from its probes and
# Service), nor abbreviate them (argparse accepts unique prefixes). Checked by the model validator (render and
# the reconcile refuse: Degraded InvalidSpec), not by CEL: prefix matching over up to 64 unbounded strings
# would risk the API server's CEL cost budget.
from .runtime import RENDERED_FLAGS  # noqa: E402


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def _int_or_string(description: str, **kw: Any) -> Any:
    return Field(default=None, description=description,
                 json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}, **kw)


def _check_quantity(value: int | str | None, field: str) -> None:
    if value is not None and not isinstance(value, int) and not re.match(QUANTITY_PATTERN, str(value)):
        raise ValueError(f"{field}: {value!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")


# ----------------------------------------------------------------------------------------- spec
class S3Location(_Model):
    """Where an s3:// model's store is (S3, or an S3-compatible store such as MinIO or Ceph)."""
    endpoint_url: str | None = Field(default=None, max_length=1024, pattern=r"^https?://[^\s]+$",
                                     description="Endpoint URL of an S3-compatible store (unset: AWS S3).")
    region: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$",
                               description="Region of the bucket (unset: the client's default).")
    addressing_style: Literal["auto", "virtual", "path"] | None = Field(
        default=None, description="Bucket in the host name (virtual) or in the path (path; most "
                                  "S3-compatible stores). Unset: auto.")


def _check_uri(value: str | None, field: str, role: str = "model") -> str | None:
    if value is not None:
        model_source.parse(value, field, role)  # ValueError naming the field and the accepted forms
    return value


class ModelSource(_Model):
    """Where the weights come from and the name clients use."""
    uri: str = Field(
        description="Model location: hf://ORG/NAME[@REVISION] (the safetensors, config and tokenizer files), "
                    "hf://ORG/NAME[@REVISION]/PATH/FILE.gguf (one GGUF file), s3://BUCKET[/PREFIX] (the same "
                    "files under the prefix, or one .gguf object) — downloaded into the model cache at the "
                    "revision the operator pins (status.model.revision) —, pvc://CLAIM/PATH (mounted "
                    "read-only), file:///PATH (a path inside the serving image), bundled://smollm2 (the "
                    "SmolLM2-135M-Instruct GGUF bundled in the CPU image).",
        max_length=1024, json_schema_extra={"pattern": MODEL_URI_PATTERN})
    name: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="Served model name (the `model` field clients send). Default: derived from the uri "
                    "(ORG/NAME for hf://, the last path element otherwise).")
    tokenizer: str | None = Field(
        default=None, max_length=1024, json_schema_extra={"pattern": MODEL_URI_PATTERN},
        description="Tokenizer to load instead of the model's own (passed as --tokenizer): a uri like "
                    "spec.model.uri; from hf:// and s3:// only the tokenizer files are downloaded.")
    credentials_secret: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret whose keys become the environment of the model download (and only of it: the "
                    "serving container never gets them): HF_TOKEN for hf://; AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) for s3://.")
    s3: S3Location | None = Field(default=None, description="Endpoint, region and addressing style of s3:// "
                                                             "uris (the model's, the draft model's, the tokenizer's).")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        return _check_uri(v, "spec.model.uri")

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str | None) -> str | None:
        return _check_uri(v, "spec.model.tokenizer", "tokenizer")


#: speculative methods kvfleet-server builds, and vLLM's trained-head methods it refuses by name: the server's
#: one refusal list (a test keeps the method enum below equal to SPECULATIVE_METHODS); "draft" is the older
#: name of draft_model.
from kvfleet_server.unsupported import SPECULATIVE_METHODS  # noqa: E402
from kvfleet_server.unsupported import UNBUILT_SPECULATIVE_METHODS as UNSUPPORTED_SPECULATIVE_METHODS  # noqa: E402


class SpeculativeConfig(_Model):
    """Speculative decoding (rendered as --speculative-config JSON, vLLM's keys)."""
    method: Literal["ngram", "draft_model", "layer_skip", "draft"] | None = Field(
        default=None, description="Proposer: ngram (prompt lookup), draft_model (a smaller model with the same "
                                  "tokenizer; draft is its older name) or layer_skip (the target's first "
                                  "numDraftLayers layers draft). Unset: no speculative decoding.")
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, le=16, description="Tokens proposed per step (1-16). Required with method.")
    draft_model: str | None = Field(
        default=None, min_length=1, max_length=1024, json_schema_extra={"pattern": MODEL_URI_PATTERN},
        description="Draft model uri (same schemes as model.uri). Required for draft_model.")
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=64,
                                          description="ngram: smallest n-gram to match in the prompt.")
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=64,
                                          description="ngram: largest n-gram to match in the prompt.")
    num_draft_layers: int | None = Field(default=None, ge=1, le=1024,
                                         description="layer_skip: target layers the drafter runs (required).")
    disable_by_batch_size: int | None = Field(
        default=None, ge=1, description="A step with more running sequences than this does not speculate.")

    @field_validator("draft_model")
    @classmethod
    def _draft_uri(cls, v: str | None) -> str | None:
        return _check_uri(v, "spec.engine.speculative.draftModel")

    @field_validator("method", mode="before")
    @classmethod
    def _refuse_unbuilt(cls, v):
        if v in UNSUPPORTED_SPECULATIVE_METHODS:
            raise ValueError(f"spec.engine.speculative.method: not supported yet: --speculative-config method {v!r} "
                             f"(needs trained draft heads; built: {', '.join(SPECULATIVE_METHODS)})")
        return v

    @model_validator(mode="after")
    def _rules(self) -> "SpeculativeConfig":
        drafty = self.method in ("draft", "draft_model")
        if drafty and not self.draft_model:
            raise ValueError("spec.engine.speculative.draftModel is required when method is draft_model")
        if not drafty and self.draft_model:
            raise ValueError("spec.engine.speculative.draftModel is only valid with method draft_model")
        if self.method is None and self.num_speculative_tokens is not None:
            raise ValueError("spec.engine.speculative.numSpeculativeTokens requires spec.engine.speculative.method")
        if self.method is not None and self.num_speculative_tokens is None:
            raise ValueError("spec.engine.speculative.numSpeculativeTokens is required with a method")
        if (self.method == "layer_skip") != (self.num_draft_layers is not None):
            raise ValueError("spec.engine.speculative.numDraftLayers is required with, and only valid with, "
                             "method layer_skip")
        if self.method != "ngram" and (self.prompt_lookup_min is not None or self.prompt_lookup_max is not None):
            raise ValueError("spec.engine.speculative.promptLookupMin/Max are only valid with method ngram")
        if (self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
                and self.prompt_lookup_min > self.prompt_lookup_max):
            raise ValueError("spec.engine.speculative.promptLookupMin must be <= promptLookupMax")
        return self


class EnvKeyRef(_Model):
    """A key of a Secret or ConfigMap in the InferenceService's namespace."""
    name: str = Field(description="Secret or ConfigMap name.", min_length=1, max_length=253)
    key: str = Field(description="Key inside it.", min_length=1, max_length=253)
    optional: bool | None = Field(default=None, description="Start even when the key is missing.")


class EnvSource(_Model):
    """Where an environment variable's value comes from."""
    secret_key_ref: EnvKeyRef | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: EnvKeyRef | None = Field(default=None, description="A key of a ConfigMap.")

    @model_validator(mode="after")
    def _one(self) -> "EnvSource":
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("spec.engine.env[].valueFrom: set exactly one of secretKeyRef or configMapKeyRef")
        return self


class EnvVar(_Model):
    """An environment variable of the server container (and of the model downloads; never a credential)."""
    name: str = Field(description="Variable name.", pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)
    value: str | None = Field(default=None, description="Literal value.", max_length=32768)
    value_from: EnvSource | None = Field(default=None, description="Value from a Secret or ConfigMap key.")

    @model_validator(mode="after")
    def _one(self) -> "EnvVar":
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"spec.engine.env[{self.name}]: set value or valueFrom, not both")
        return self


class EngineConfig(_Model):
    """Serving engine settings; each field is rendered as the server's vLLM-style flag (both runtimes)."""
    runtime: Literal["kvfleet", "vllm"] = Field(
        default="kvfleet", description="Serving engine: kvfleet (kvfleet-server) or vllm (upstream vLLM, `vllm "
                                       "serve` in the vllm/vllm-openai image: the chart's vllmImage). The same "
                                       "fields render the same vLLM-style flags, probes, port and metrics; a "
                                       "setting vLLM lacks (speculative method layer_skip, quantization "
                                       "int8/int4, CPU serving, kvfleet-only extraArgs) is refused, naming the "
                                       "field.")
    image: str | None = Field(default=None, min_length=1, max_length=512,
                              description="Serving image running the runtime's server. Unset: the operator's "
                                          "image for the runtime (the chart's servingImage, or vllmImage for "
                                          "runtime vllm), so an upgrade moves every object that does not pin one.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy of the server container. Unset: the operator's "
                                  "(the chart's servingImage.pullPolicy).")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default="auto", description="Weights and activations dtype (--dtype).")
    quantization: Literal["none", "fp8", "int8", "int4", "gguf"] = Field(
        default="none", description="Weight quantization (--quantization; none renders no flag: the checkpoint's "
                                    "dtype, a .gguf file served packed). fp8/int8/int4 quantize a float checkpoint "
                                    "at load; gguf keeps a GGUF file's Q4_0/Q4_1/Q8_0 tensors packed.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto", description="KV cache dtype (--kv-cache-dtype): auto = the model dtype; fp8 (= fp8_e4m3) "
                                    "or fp8_e5m2 store K and V in 8 bits with per-layer scales.")
    tensor_parallel_size: Literal[1, 2, 4, 8] = Field(
        default=1, description="GPUs one replica shards the model over (--tensor-parallel-size).")
    gpu_memory_utilization: float = Field(
        default=0.9, ge=0.1, le=0.99,
        description="Fraction of GPU memory for weights + KV cache (--gpu-memory-utilization).")
    max_model_len: int | None = Field(default=None, ge=16, le=1048576,
                                      description="Context length limit in tokens (--max-model-len).")
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096,
                                     description="Sequences batched per step (--max-num-seqs).")
    max_num_batched_tokens: int | None = Field(default=None, ge=16, le=1048576,
                                               description="Tokens per scheduler step (--max-num-batched-tokens).")
    block_size: Literal[8, 16, 32, 64, 128] = Field(default=16, description="KV cache block size in tokens (--block-size).")
    enable_prefix_caching: bool = Field(
        default=True, description="Automatic prefix caching (--enable-prefix-caching / --no-enable-prefix-caching).")
    shutdown_timeout_seconds: int = Field(
        default=30, ge=0, le=3600,
        description="Drain time for in-flight requests after SIGTERM (--shutdown-timeout); "
                    "terminationGracePeriodSeconds is derived from it.")
    speculative: SpeculativeConfig | None = Field(default=None, description="Speculative decoding.")
    max_loras: int | None = Field(
        default=None, ge=1, le=64,
        description="LoRA adapters that can run in one batch (--max-loras). Default: the number of "
                    "spec.adapters, at most 8. Only with spec.adapters.")
    max_lora_rank: int = Field(default=16, ge=1, le=512,
                               description="Largest adapter rank r (--max-lora-rank); an adapter of a higher "
                                           "rank is refused by the server. Only with spec.adapters.")
    max_cpu_loras: int | None = Field(default=None, ge=1, le=1024,
                                      description="Adapters kept in host memory (--max-cpu-loras; default: "
                                                  "maxLoras). Only with spec.adapters.")
    extra_args: list[str] = Field(default_factory=list, max_length=64,
                                  description="Extra flags of the runtime's server (kvfleet-server or vllm "
                                              "serve), appended after the rendered ones (flags rendered from spec "
                                              "fields, e.g. --port, are refused).")
    env: list[EnvVar] = Field(default_factory=list, max_length=64,
                              description="Environment variables of the server container (names unique).",
                              json_schema_extra={"x-kubernetes-list-type": "map",
                                                 "x-kubernetes-list-map-keys": ["name"]})

    @model_validator(mode="after")
    def _rules(self) -> "EngineConfig":
        for arg in self.extra_args:
            option = arg.split("=", 1)[0]
            flag = next((f for f in RENDERED_FLAGS if len(option) > 2 and f.startswith(option)), None)
            if option.startswith("--") and flag is not None:
                raise ValueError(f"spec.engine.extraArgs: {arg!r} overrides the rendered flag {flag} "
                                 f"(set {RENDERED_FLAGS[flag]} instead)")
        names = [v.name for v in self.env]
        secret = sorted(set(names) & set(CREDENTIAL_ENV))
        if secret:
            raise ValueError(f"spec.engine.env: {', '.join(secret)} is a credential: put it in the Secret named by "
                             f"spec.model.credentialsSecret (the model download gets it, the server never does)")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"spec.engine.env: duplicate names {dup}")
        return self


class Autoscaling(_Model):
    """Replica autoscaling on KV-cache usage and queue length (the operator's own autoscaler)."""
    enabled: bool = Field(default=False, description="Let the operator set the Deployment's replicas; "
                                                     "spec.replicas is then ignored.")
    min_replicas: int = Field(default=1, ge=1, le=1000,
                              description="Lower bound (scale to zero is not supported yet).")
    max_replicas: int | None = Field(default=None, ge=1, le=1000,
                                     description="Upper bound; required when enabled.")
    target_kv_cache_usage: float = Field(default=0.8, gt=0.0, le=1.0, alias="targetKVCacheUsage",
                                         description="Target mean KV-cache usage per ready replica (0-1].")
    target_queue_length: float = Field(default=5, gt=0, le=10000,
                                       description="Target waiting requests per ready replica.")
    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600,
                                                description="Wait before acting on a scale-up recommendation.")
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=86400,
        description="Scale down only to the highest recommendation seen within this window.")
    metrics_interval_seconds: int = Field(default=15, ge=1, le=3600,
                                          description="How often pods' /metrics are scraped.")

    @model_validator(mode="after")
    def _rules(self) -> "Autoscaling":
        if self.enabled and self.max_replicas is None:
            raise ValueError("spec.autoscaling.maxReplicas is required when autoscaling is enabled")
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas")
        return self


class Resources(_Model):
    """Compute resources of one replica."""
    gpus: int | None = Field(default=None, ge=0, le=16,
                             description="GPUs per replica (default: engine.tensorParallelSize; 0 runs on CPU).")
    gpu_resource_name: str = Field(default="nvidia.com/gpu", min_length=1, max_length=253,
                                   pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$",
                                   description="Extended resource name of the GPU.")
    cpu: int | str | None = _int_or_string("CPU request of the server container (Kubernetes quantity). Unset: "
                                           "none on CPU replicas; the operator's CPUs per GPU (default 4) times "
                                           "gpus on GPU replicas.")
    memory: int | str | None = _int_or_string("Memory request and limit of the server container (quantity); must "
                                              "exceed shmSize. Unset: none on CPU replicas; a request (no limit) of "
                                              "the operator's memory per GPU (default 24Gi) times gpus, plus /dev/shm, on "
                                              "GPU replicas.")
    shm_size: int | str | None = _int_or_string("Size limit of the memory-backed /dev/shm the tensor-parallel "
                                                "workers share (quantity; counts against memory). Unset: the "
                                                "operator's /dev/shm per GPU (default 1Gi) times tensorParallelSize, "
                                                "and no /dev/shm with tensorParallelSize 1.")

    @model_validator(mode="after")
    def _quantities(self) -> "Resources":
        _check_quantity(self.cpu, "spec.resources.cpu")
        _check_quantity(self.memory, "spec.resources.memory")
        _check_quantity(self.shm_size, "spec.resources.shmSize")
        return self


class Toleration(_Model):
    """A Kubernetes toleration."""
    key: str | None = Field(default=None, max_length=253, description="Taint key (empty with Exists: all).")
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Exists or Equal (default).")
    value: str | None = Field(default=None, max_length=253, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate (empty: all).")
    toleration_seconds: int | None = Field(default=None, ge=0, description="NoExecute: how long to stay bound.")


class Scheduling(_Model):
    """Where replicas may run."""
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Pod tolerations.")
    affinity: dict[str, Any] | None = Field(default=None, description="Pod affinity (the core/v1 Affinity object; "
                                                                      "checked against Kubernetes' schema at render).",
                                            json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    topology_spread_constraints: list[dict[str, Any]] | None = Field(
        default=None, max_length=16,
        description="Pod topologySpreadConstraints (core/v1 TopologySpreadConstraint objects, checked against "
                    "Kubernetes' schema at render), replacing the default: replicas spread across nodes "
                    "(kubernetes.io/hostname, maxSkew 1, ScheduleAnyway). [] renders none.",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}})
    priority_class_name: str | None = Field(default=None, max_length=253, description="Pod priorityClassName.")
    runtime_class_name: str | None = Field(default=None, max_length=253, description="Pod runtimeClassName.")


class Probes(_Model):
    """Health checking."""
    startup_timeout_seconds: int = Field(
        default=1800, ge=10, le=86400,
        description="Time a replica may take to load the model before it is restarted "
                    "(startupProbe periodSeconds x failureThreshold).")


class ServiceConfig(_Model):
    """The Service in front of the replicas."""
    port: int = Field(default=8000, ge=1, le=65535, description="Service port (named http); also the server port.")
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP", description="Service type.")


class EmptyDirCache(_Model):
    """A per-pod emptyDir model cache."""
    size_limit: int | str | None = _int_or_string("Size limit of the emptyDir (quantity).")

    @model_validator(mode="after")
    def _quantity(self) -> "EmptyDirCache":
        _check_quantity(self.size_limit, "spec.modelCache.emptyDir.sizeLimit")
        return self


class SharedCache(_Model):
    """A model cache the operator creates: one PersistentVolumeClaim per InferenceService, filled once per
    model revision by a download Job, mounted read-only by every replica."""
    size: int | str = Field(description="Storage requested (quantity, e.g. 40Gi): the served revision plus the "
                                        "next one of every downloaded source (docs/operator.md sizes it).",
                            json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN})
    storage_class_name: str | None = Field(default=None, min_length=1, max_length=253,
                                           description="StorageClass of the claim (unset: the cluster's default).")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = Field(
        default="ReadWriteMany", description="ReadWriteMany (a shared file system: replicas on any node) or "
                                             "ReadWriteOnce (the download and every replica on one node).")

    @model_validator(mode="after")
    def _quantity(self) -> "SharedCache":
        _check_quantity(self.size, "spec.modelCache.shared.size")
        return self


class ModelCache(_Model):
    """Volume that hf:// and s3:// downloads go to (default: a per-pod emptyDir)."""
    persistent_volume_claim: str | None = Field(default=None, pattern=DNS1035.replace("{0,61}", "{0,251}"),
                                                description="Existing PVC (ReadWriteMany to share across replicas); "
                                                            "each pod's init container fills it.")
    empty_dir: EmptyDirCache | None = Field(default=None, description="Per-pod emptyDir cache; its sizeLimit is "
                                                                      "also requested as ephemeral-storage.")
    shared: SharedCache | None = Field(default=None, description="A claim the operator creates and fills once per "
                                                                 "model revision (download Job); pods start after.")

    @model_validator(mode="after")
    def _one(self) -> "ModelCache":
        if sum(x is not None for x in (self.persistent_volume_claim, self.empty_dir, self.shared)) > 1:
            raise ValueError("spec.modelCache: set one of persistentVolumeClaim, emptyDir or shared")
        return self


class LocalObjectReference(_Model):
    """A reference to an object in the InferenceService's namespace, by name."""
    name: str = Field(description="Object name.", min_length=1, max_length=253)


DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class GatewayReference(_Model):
    """The Gateway (gateway.networking.k8s.io/v1) whose listener routes to the InferencePool."""
    name: str = Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN, description="Gateway name.")
    namespace: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=DNS1123_LABEL,
        description="Gateway namespace. Default: the InferenceService's (another namespace's listener must allow "
                    "routes from this one: allowedRoutes.namespaces).")
    section_name: str | None = Field(default=None, min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN,
                                     description="Listener of the Gateway (HTTPRoute parentRefs[].sectionName). "
                                                 "Unset: every listener that allows the route.")


class EndpointPickerResources(_Model):
    """Compute requests of the endpoint picker (its memory limit is twice the memory request)."""
    cpu: int | str = Field(default="500m", json_schema_extra={"x-kubernetes-int-or-string": True,
                                                              "pattern": QUANTITY_PATTERN},
                           description="CPU request (upstream sizes 4 CPUs for high request rates).")
    memory: int | str = Field(default="512Mi", json_schema_extra={"x-kubernetes-int-or-string": True,
                                                                 "pattern": QUANTITY_PATTERN},
                              description="Memory request; the limit is twice it (upstream: 8Gi, limit 16Gi).")

    @model_validator(mode="after")
    def _quantities(self) -> "EndpointPickerResources":
        _check_quantity(self.cpu, "spec.routing.inferencePool.endpointPicker.resources.cpu")
        _check_quantity(self.memory, "spec.routing.inferencePool.endpointPicker.resources.memory")
        return self


class EndpointPicker(_Model):
    """The endpoint picker (EPP) the Gateway asks which replica takes each request (docs/routing.md)."""
    prefix_cache: Literal["approximate", "precise"] = Field(
        default="approximate",
        description="Prefix-cache scoring: approximate (the EPP indexes the prompts it routed, blocks of "
                    "max(64, engine.blockSize) tokens) or precise (the EPP subscribes to every replica's KV events, "
                    "--kv-events-config on port 5557, and scores the blocks each replica actually holds; needs "
                    "engine.enablePrefixCaching).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailOpen", description="What the Gateway does when the picker does not answer: FailOpen sends the "
                                        "request to any ready replica, FailClose refuses it (InferencePool "
                                        "endpointPickerRef.failureMode).")
    image: str | None = Field(default=None, min_length=1, max_length=512,
                              description="Endpoint picker image. Unset: the operator's (the chart's "
                                          "routing.endpointPickerImage, a pinned llm-d-router release).")
    resources: EndpointPickerResources = Field(default_factory=EndpointPickerResources,
                                               description="Requests of the endpoint picker container.")


class InferencePoolRouting(_Model):
    """Route through a Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1)."""
    gateway: GatewayReference | None = Field(
        default=None, description="Gateway to attach an HTTPRoute to (path prefix /, every request to the pool). "
                                  "Unset: no HTTPRoute; route to the InferencePool yourself.")
    endpoint_picker: EndpointPicker = Field(default_factory=EndpointPicker, description="The endpoint picker.")


class LoRAAdapterSpec(_Model):
    """One LoRA adapter served beside the base model (docs/lora.md): clients pick it by ``name``."""
    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
                      description="The `model` name clients send to use the adapter (listed by /v1/models with "
                                  "the base model as parent).")
    uri: str = Field(max_length=1024, description="The PEFT adapter folder (adapter_config.json + "
                                                  "adapter_model.safetensors): hf://ORG/REPO[@REVISION], "
                                                  "s3://BUCKET[/PREFIX], pvc://CLAIM/PATH or file:///PATH, "
                                                  "downloaded and pinned like spec.model.uri.")


class Routing(_Model):
    """Cache-aware routing across replicas (docs/routing.md). Unset: the Service spreads requests."""
    inference_pool: InferencePoolRouting | None = Field(
        default=None, description="Render an InferencePool, its endpoint picker and (with a gateway) an HTTPRoute.")


class InferenceServiceSpec(_Model):
    """Desired state of an InferenceService."""
    model: ModelSource = Field(description="The model to serve.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Serving engine settings.")
    replicas: int = Field(default=1, ge=0, le=1000,
                          description="Replicas when autoscaling is disabled (scale subresource). "
                                      "Ignored while autoscaling.enabled.")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description="Autoscaling.")
    resources: Resources = Field(default_factory=Resources, description="Per-replica resources.")
    scheduling: Scheduling = Field(default_factory=Scheduling, description="Pod scheduling.")
    probes: Probes = Field(default_factory=Probes, description="Health checks.")
    service: ServiceConfig = Field(default_factory=ServiceConfig, description="Service.")
    model_cache: ModelCache = Field(default_factory=ModelCache, description="Model download cache.")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16,
        description="Secrets for pulling the serving image from a private registry (pod imagePullSecrets).")
    service_account_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="ServiceAccount of the serving pods (e.g. for cloud workload identity to a model bucket). "
                    "Unset: the namespace's default. The pods still mount no API token.")
    routing: Routing = Field(default_factory=Routing, description="Cache-aware routing across replicas.")
    adapters: list[LoRAAdapterSpec] = Field(
        default_factory=list, max_length=64,
        description="LoRA adapters of the base model, each served under its own name (rendered as --enable-lora "
                    "--lora-modules; status.adapters counts the ready replicas serving each).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})

    @model_validator(mode="after")
    def _rules(self) -> "InferenceServiceSpec":
        self._adapter_rules()
        g, tp = self.resources.gpus, self.engine.tensor_parallel_size
        if g is not None and g < tp and not (g == 0 and tp == 1):
            raise ValueError(f"spec.resources.gpus ({g}) must be >= spec.engine.tensorParallelSize ({tp})")
        uri = self.model.uri
        if self.engine.quantization == "gguf" and not (uri.endswith(".gguf") or uri == "bundled://smollm2"):
            raise ValueError(f"spec.engine.quantization gguf needs a .gguf model file (or bundled://smollm2), "
                             f"got spec.model.uri {uri!r}")
        pool = self.routing.inference_pool
        if pool is not None and pool.endpoint_picker.prefix_cache == "precise":
            if not self.engine.enable_prefix_caching:
                raise ValueError("spec.routing.inferencePool.endpointPicker.prefixCache precise needs "
                                 "spec.engine.enablePrefixCaching (no cached block, no KV event)")
            if any(a.split("=", 1)[0] == "--kv-events-config" for a in self.engine.extra_args):
                raise ValueError("spec.engine.extraArgs: --kv-events-config is rendered by "
                                 "spec.routing.inferencePool.endpointPicker.prefixCache precise")
        stores = {model_source.parse(u, "uri").store for u in self.model_uris()}
        if self.model.s3 is not None and "s3" not in stores:
            raise ValueError("spec.model.s3: no s3:// uri uses it")
        if self.model.credentials_secret is not None and not stores & {"hf", "s3"}:
            raise ValueError("spec.model.credentialsSecret: nothing is downloaded (no hf:// or s3:// uri)")
        if self.model_cache.shared is not None and not stores & {"hf", "s3"}:
            raise ValueError("spec.modelCache.shared: nothing is downloaded (no hf:// or s3:// uri)")
        return self

    def _adapter_rules(self) -> None:
        names = set()
        for i, a in enumerate(self.adapters):
            model_source.parse(a.uri, f"spec.adapters[{i}].uri", "adapter")
            if a.name in names:
                raise ValueError(f"spec.adapters[{i}].name: {a.name!r} is given twice")
            names.add(a.name)
        e = self.engine
        if not self.adapters:
            set_fields = [f for f, v in (("maxLoras", e.max_loras), ("maxCpuLoras", e.max_cpu_loras)) if v is not None]
            if set_fields:
                raise ValueError(f"spec.engine.{set_fields[0]}: needs spec.adapters")
            return
        if self.served_model_name in names:
            raise ValueError(f"spec.adapters: the name {self.served_model_name!r} is the base model's")
        if e.max_cpu_loras is not None and e.max_cpu_loras < self.max_loras:
            raise ValueError(f"spec.engine.maxCpuLoras ({e.max_cpu_loras}) must be >= spec.engine.maxLoras "
                             f"({self.max_loras})")

    @property
    def max_loras(self) -> int:
        """--max-loras: engine.maxLoras, or the number of adapters, at most 8."""
        return self.engine.max_loras or min(len(self.adapters), 8)

    def model_uris(self) -> list[str]:
        """The uris of the model, the draft model, the tokenizer and the adapters that are set."""
        sp = self.engine.speculative
        return [u for u in (self.model.uri, sp.draft_model if sp else None, self.model.tokenizer,
                            *(a.uri for a in self.adapters)) if u]

    @property
    def gpus(self) -> int:
        """GPUs per replica after defaulting (tensorParallelSize when unset)."""
        return self.engine.tensor_parallel_size if self.resources.gpus is None else self.resources.gpus

    @property
    def served_model_name(self) -> str:
        """model.name, or derived from the uri: ORG/NAME for hf:// (a .gguf file's too), else the last path
        element."""
        if self.model.name:
            return self.model.name
        source = model_source.parse(self.model.uri, "spec.model.uri")
        if source.store == "hf":
            return source.name
        rest = self.model.uri.split("://", 1)[1]
        last = rest.rstrip("/").rsplit("/", 1)[-1]
        return last or rest


# CEL rules (x-kubernetes-validations) attached by crdgen; each mirrors a model validator above.
ROOT_RULES = [
    {"rule": f"self.metadata.name.matches('{DNS1035}')",
     "message": "metadata.name must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter, "
                "at most 63 characters): it names the Service",
     "reason": "FieldValueInvalid"},  # no fieldPath: the CRD schema does not declare metadata's fields
]
SPEC_RULES = [
    {"rule": "!has(self.routing) || !has(self.routing.inferencePool) || "
             "!has(self.routing.inferencePool.endpointPicker) || "
             "!has(self.routing.inferencePool.endpointPicker.prefixCache) || "
             "self.routing.inferencePool.endpointPicker.prefixCache != 'precise' || "
             "!has(self.engine) || !has(self.engine.enablePrefixCaching) || self.engine.enablePrefixCaching",
     "message": "spec.routing.inferencePool.endpointPicker.prefixCache precise needs spec.engine.enablePrefixCaching",
     "fieldPath": ".routing.inferencePool.endpointPicker.prefixCache", "reason": "FieldValueInvalid"},
    {"rule": "!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus >= "
             "(has(self.engine) && has(self.engine.tensorParallelSize) ? self.engine.tensorParallelSize : 1) || "
             "(self.resources.gpus == 0 && (!has(self.engine) || !has(self.engine.tensorParallelSize) || "
             "self.engine.tensorParallelSize == 1))",
     "message": "spec.resources.gpus must be >= spec.engine.tensorParallelSize (0 only with tensorParallelSize 1)",
     "fieldPath": ".resources.gpus", "reason": "FieldValueInvalid"},
]
AUTOSCALING_RULES = [
    {"rule": "!has(self.maxReplicas) || !has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
     "message": "spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas",
     "fieldPath": ".minReplicas", "reason": "FieldValueInvalid"},
    {"rule": "!has(self.enabled) || !self.enabled || has(self.maxReplicas)",
     "message": "spec.autoscaling.maxReplicas is required when autoscaling is enabled",
     "fieldPath": ".maxReplicas", "reason": "FieldValueRequired"},
]
SPECULATIVE_RULES = [
    {"rule": "!has(self.method) || !(self.method in ['draft', 'draft_model']) || has(self.draftModel)",
     "message": "spec.engine.speculative.draftModel is required when method is draft_model",
     "fieldPath": ".draftModel", "reason": "FieldValueRequired"},
    {"rule": "(has(self.method) && self.method in ['draft', 'draft_model']) || !has(self.draftModel)",
     "message": "spec.engine.speculative.draftModel is only valid with method draft_model",
     "fieldPath": ".draftModel", "reason": "FieldValueForbidden"},
    {"rule": "has(self.method) || !has(self.numSpeculativeTokens)",
     "message": "spec.engine.speculative.numSpeculativeTokens requires spec.engine.speculative.method",
     "fieldPath": ".numSpeculativeTokens", "reason": "FieldValueForbidden"},
    {"rule": "!has(self.method) || has(self.numSpeculativeTokens)",
     "message": "spec.engine.speculative.numSpeculativeTokens is required with a method",
     "fieldPath": ".numSpeculativeTokens", "reason": "FieldValueRequired"},
    {"rule": "(has(self.method) && self.method == 'layer_skip') == has(self.numDraftLayers)",
     "message": "spec.engine.speculative.numDraftLayers is required with, and only valid with, method layer_skip",
     "fieldPath": ".numDraftLayers", "reason": "FieldValueInvalid"},
    {"rule": "(has(self.method) && self.method == 'ngram') || (!has(self.promptLookupMin) && !has(self.promptLookupMax))",
     "message": "spec.engine.speculative.promptLookupMin/Max are only valid with method ngram",
     "fieldPath": ".method", "reason": "FieldValueForbidden"},
    {"rule": "!has(self.promptLookupMin) || !has(self.promptLookupMax) || self.promptLookupMin <= self.promptLookupMax",
     "message": "spec.engine.speculative.promptLookupMin must be <= promptLookupMax",
     "fieldPath": ".promptLookupMin", "reason": "FieldValueInvalid"},
]
ENV_RULES = [  # one env item
    {"rule": "!(has(self.value) && has(self.valueFrom))",
     "message": "spec.engine.env[]: set value or valueFrom, not both", "reason": "FieldValueForbidden"},
    {"rule": f"!(self.name in {list(CREDENTIAL_ENV)})",
     "message": "spec.engine.env[]: a credential (HF_TOKEN, AWS keys) belongs in the Secret named by "
                "spec.model.credentialsSecret: the model download gets it, the server never does",
     "reason": "FieldValueForbidden"},
]
ENV_SOURCE_RULES = [
    {"rule": "has(self.secretKeyRef) != has(self.configMapKeyRef)",
     "message": "spec.engine.env[].valueFrom: set exactly one of secretKeyRef or configMapKeyRef",
     "reason": "FieldValueInvalid"},
]
MODEL_CACHE_RULES = [
    {"rule": "(has(self.persistentVolumeClaim) ? 1 : 0) + (has(self.emptyDir) ? 1 : 0) + (has(self.shared) ? 1 : 0) "
             "<= 1",
     "message": "spec.modelCache: set one of persistentVolumeClaim, emptyDir or shared",
     "reason": "FieldValueForbidden"},
]


# --------------------------------------------------------------------------------------- status
class Condition(_Model):
    """A status condition, the shape `kubectl wait --for=condition=Ready` and Argo CD read."""
    type: str = Field(description="Ready, Progressing, Degraded (reconcile) or another controller's type.",
                      max_length=316)
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, max_length=1024, description="CamelCase reason of the last transition.")
    message: str | None = Field(default=None, max_length=32768, description="Human-readable details.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).",
                                             json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(default=None, ge=0,
                                            description="metadata.generation this condition was computed for.")


class AutoscalingStatus(_Model):
    """Written by the autoscaler (never by the reconcile)."""
    last_scale_time: str | None = Field(default=None, description="Time of the last replica change (RFC 3339).",
                                        json_schema_extra={"format": "date-time"})
    reason: str | None = Field(default=None, max_length=1024,
                               description="CamelCase reason of the last decision (e.g. KVCacheUsageHigh, "
                                           "MetricsUnavailable).")
    message: str | None = Field(default=None, max_length=32768,
                                description="Last decision in words, e.g. 'scaled 2->4: kv cache usage 0.93 > "
                                            "target 0.80'.")
    kv_cache_usage: float | None = Field(default=None, ge=0, description="Mean KV-cache usage of scraped pods (0-1).")
    waiting_requests: float | None = Field(default=None, ge=0, description="Waiting requests summed over scraped pods.")
    running_requests: float | None = Field(default=None, ge=0, description="Running requests summed over scraped pods.")
    scraped_pods: int | None = Field(default=None, ge=0, description="Ready pods whose metrics were read.")
    recommendation: int | None = Field(default=None, ge=0, description="Last recommended replica count.")


class RoutingStatus(_Model):
    """What the reconcile rendered for spec.routing (absent without routing)."""
    inference_pool: str | None = Field(default=None, description="InferencePool name (inference.networking.k8s.io/v1).")
    endpoint_picker: str | None = Field(default=None, description="Service of the endpoint picker "
                                                                  "(endpointPickerRef), port 9002.")
    prefix_cache: str | None = Field(default=None, description="approximate or precise prefix-cache scoring.")
    http_route: str | None = Field(default=None, description="HTTPRoute name, when a gateway is set.")
    gateway: str | None = Field(default=None, description="NAMESPACE/NAME of the Gateway the route attaches to.")


class ModelSourceStatus(_Model):
    """One downloaded source and the revision pinned for it."""
    field: str = Field(description="The spec field naming it (spec.model.uri, spec.engine.speculative.draftModel, "
                                   "spec.model.tokenizer).", max_length=256)
    uri: str = Field(description="Its uri.", max_length=1024)
    revision: str = Field(description="Commit (hf://) or ETag digest (s3://) every replica fetches.", max_length=256)


class ModelStatus(_Model):
    """The model served and the revisions pinned for this generation."""
    name: str | None = Field(default=None, max_length=256, description="Served model name.")
    revision: str | None = Field(default=None, max_length=256,
                                 description="Commit (hf://) or ETag digest (s3://) of spec.model.uri pinned for "
                                             "this generation; unset for pvc://, file://, bundled://.")
    generation: int | None = Field(default=None, ge=0, description="metadata.generation the revisions were "
                                                                   "resolved for (once per generation).")
    sources: list[ModelSourceStatus] = Field(default_factory=list, max_length=8,
                                             description="Every downloaded source with its pinned revision.")


class AdapterStatus(_Model):
    """How many ready replicas serve one adapter of spec.adapters."""
    name: str = Field(description="The adapter's name.", max_length=256)
    ready_replicas: int = Field(ge=0, description="Ready pods whose server was started with the adapter.")


class InferenceServiceStatus(_Model):
    """Observed state, written by the operator through the status subresource."""
    observed_generation: int | None = Field(default=None, ge=0,
                                            description="metadata.generation the reconcile last acted on.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded.",
                                        json_schema_extra={"x-kubernetes-list-type": "map",
                                                           "x-kubernetes-list-map-keys": ["type"]})
    replicas: int | None = Field(default=None, ge=0, description="Pods of the Deployment (scale subresource).")
    ready_replicas: int | None = Field(default=None, ge=0, description="Pods passing their readiness probe.")
    updated_replicas: int | None = Field(default=None, ge=0, description="Pods running the current template.")
    desired_replicas: int | None = Field(default=None, ge=0,
                                         description="Replicas asked of the Deployment (spec.replicas, or the "
                                                     "autoscaler's decision).")
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    url: str | None = Field(default=None, description="OpenAI base URL inside the cluster: http://NAME.NAMESPACE.svc:PORT/v1.")
    model: ModelStatus | None = Field(default=None, description="Served model name and pinned revisions.")
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The autoscaler's last decision.")
    routing: RoutingStatus | None = Field(default=None, description="The InferencePool and route, with spec.routing.")
    adapters: list[AdapterStatus] | None = Field(default=None, max_length=64,
                                                 description="Ready replicas per adapter, with spec.adapters.")
