"""Model weights through the real clients: huggingface_hub against a Hub on 127.0.0.1 (``HF_ENDPOINT``), boto3
against moto's S3 emulator; the downloader run exactly as the rendered container runs it; kvfleet-server serving
the result through the openai client.

The model is SmolLM2-135M-Instruct made from the bundled GGUF (transformers dequantizes it; saved as two
bfloat16 safetensors shards with their index, the config, the generation config and the tokenizer with its chat
template). The Hub repository also holds an ``original/consolidated.pth`` decoy and gets a second commit after
the operator pinned the first; the same files sit under an S3 prefix. The GGUF itself sits in a second (gated)
repository.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model_stores import free_port, moto_s3
from kvfleet_operator import cache, render, resolve
from kvfleet_operator.model_source import MODEL_ROOT

pytestmark = pytest.mark.slow
REPO, GGUF_REPO, TOKEN = "HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "hf_test"
NEEDED = {"config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
          "chat_template.jinja",
          "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory) -> dict[str, bytes]:
    """SmolLM2-135M-Instruct as a Hub repository holds it (safetensors), plus the decoy and a README."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvfleet_server.config import bundled_model_path

    gguf = bundled_model_path()
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    out = tmp_path_factory.mktemp("smollm2_hf")
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # dequantized: a plain checkpoint
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, str(out / name))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}))
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(str(out))
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    files["original/consolidated.pth"] = b"\0" * (1 << 20)  # Meta's own format: never fetched
    files["README.md"] = b"# SmolLM2"
    return files


def isvc(model: dict, cache_spec: dict) -> dict:
    return {"apiVersion": "serving.kvfleet.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "smol", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"model": model, "modelCache": cache_spec,
                     "engine": {"dtype": "float32", "maxModelLen": 512,
                                # a common serving setting: must not stop the download
                                "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]},
                     "resources": {"gpus": 0, "cpu": "1"}}}


def pinned(obj: dict) -> dict:
    """The pins the reconcile resolves (weights.pin_sources -> resolve), against the stores of this test."""
    spec = render.parse_spec(obj)
    return {s.uri: resolve.resolve_sync(s, cache.s3_options(spec)) for s in cache.downloaded(spec)}


def download_container(obj: dict, pins: dict) -> dict:
    """The download container the reconcile renders: the shared cache's Job, else the pod's init container."""
    spec = render.parse_spec(obj)
    if spec.model_cache.shared:
        (source,) = cache.downloaded(spec)
        dl = render.downloader(spec, render.ServingDefaults(), resolve.hf_endpoint())
        job = cache.download_job(obj, spec, source, pins[source.uri], dl, [], None, render.pod_security_context())
        return job["spec"]["template"]["spec"]["containers"][0]
    pod = render.render(obj, pins=pins, hf_endpoint=resolve.hf_endpoint()).deployment["spec"]["template"]["spec"]
    (box,) = pod["initContainers"]
    return box


def run_as_kubelet(box: dict, volume: Path, secret: dict[str, str], tmp: Path) -> subprocess.CompletedProcess:
    """Run a rendered container's command as the kubelet would: its args and env, the Secret of envFrom as
    environment, the model-cache volume mounted at MODEL_ROOT and the tmp emptyDir at /tmp (paths mapped to
    this machine's folders). The console script kvfleet-download is kvfleet_server.download's main."""
    assert box["command"] == ["kvfleet-download"]
    assert box["envFrom"] == [{"secretRef": {"name": "store-secret"}}]

    def mount(text: str) -> str:
        return str(volume) + text[len(MODEL_ROOT):] if text.startswith(MODEL_ROOT) else \
            str(tmp) + text[len("/tmp"):] if text.startswith("/tmp") else text
    env = {e["name"]: mount(e["value"]) for e in box["env"]}
    env.update(secret)
    env.update(PATH=os.environ["PATH"], PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "kvfleet_server.download", *map(mount, box["args"])], env=env,
                          capture_output=True, text=True, timeout=300)


def served_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts}


def serve_and_ask(obj: dict, pins: dict, volume: Path, chat: bool) -> str:
    """Start kvfleet-server with the rendered server arguments (the cache mounted at MODEL_ROOT) and ask it."""
    from openai import OpenAI

    box = render.render(obj, pins=pins).deployment["spec"]["template"]["spec"]["containers"][0]
    args = [str(volume) + a[len(MODEL_ROOT):] if a.startswith(MODEL_ROOT) else a for a in box["args"]]
    port = free_port()
    args[args.index("--port") + 1], args[args.index("--host") + 1] = str(port), "127.0.0.1"
    log = volume / f"server-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvfleet_server.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                import httpx

                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        name = args[args.index("--served-model-name") + 1]
        if chat:
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 2+2?"}],
                                               max_tokens=12, temperature=0)
            return r.choices[0].message.content
        return client.completions.create(model=name, prompt="The capital of France is", max_tokens=8,
                                         temperature=0).choices[0].text
    finally:
        proc.terminate()
        proc.wait(30)


def test_pinned_needed_files_only_through_hub_and_s3_then_served(fake_hub, smollm2_files, tmp_path, monkeypatch):
    import boto3

    from kvfleet_server.config import bundled_model_path

    gguf_name = os.path.basename(bundled_model_path())
    c1 = fake_hub.commit(REPO, smollm2_files, token=TOKEN, gated=True)  # metadata public, files need the token
    fake_hub.commit(GGUF_REPO, {gguf_name: Path(bundled_model_path()).read_bytes(), "README.md": b"#"},
                    token=TOKEN, gated=True)

    # --- hf://, shared cache: the operator pins main (c1), then main moves; the Job fetches c1, only what serving needs
    obj = isvc({"uri": f"hf://{REPO}", "credentialsSecret": "store-secret"}, {"shared": {"size": "1Gi"}})
    pins = pinned(obj)
    assert pins[f"hf://{REPO}"].revision == c1
    c2 = fake_hub.commit(REPO, {**smollm2_files, "generation_config.json": b'{"temperature": 0.1}'},
                         token=TOKEN, gated=True)
    volume = tmp_path / "volume"
    box = download_container(obj, pins)
    denied = run_as_kubelet(box, volume, {}, tmp_path / "tmp0")  # without the Secret's token: refused, named
    assert denied.returncode == 3
    assert denied.stderr.strip().splitlines()[-1].startswith(f"error: Unauthorized: hf://{REPO}@{c1}: gated")
    done = run_as_kubelet(box, volume, {"HF_TOKEN": TOKEN}, tmp_path / "tmp1")
    assert done.returncode == 0, done.stderr
    folder = volume / "hf" / REPO / c1
    assert served_files(folder) == NEEDED
    assert (folder / "generation_config.json").read_bytes() == smollm2_files["generation_config.json"]  # c1, not c2
    assert not fake_hub.fetched("original/consolidated.pth") and not fake_hub.fetched("README.md")
    assert not any(c2 in path for _, path in fake_hub.requests)

    # --- s3://: the same files under a prefix of moto's S3 (path style, region); pinned by the ETag digest
    with moto_s3() as endpoint:
        for key, value in (("AWS_ACCESS_KEY_ID", "operator"), ("AWS_SECRET_ACCESS_KEY", "x"),
                           ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(key, value)  # the operator's own identity (it resolves; the Job downloads)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="models")
        for name, body in smollm2_files.items():
            s3.put_object(Bucket="models", Key=f"smollm2/{name}", Body=body)
        obj_s3 = isvc({"uri": "s3://models/smollm2", "credentialsSecret": "store-secret",
                       "s3": {"endpointUrl": endpoint, "region": "us-east-1", "addressingStyle": "path"}},
                      {"shared": {"size": "1Gi"}})
        pins_s3 = pinned(obj_s3)
        secret = {"AWS_ACCESS_KEY_ID": "downloader", "AWS_SECRET_ACCESS_KEY": "y"}
        done = run_as_kubelet(download_container(obj_s3, pins_s3), volume, secret, tmp_path / "tmp2")
        assert done.returncode == 0, done.stderr
        s3_folder = volume / "s3" / "models" / "smollm2" / pins_s3["s3://models/smollm2"].revision
        assert served_files(s3_folder) == NEEDED
        assert all((s3_folder / n).read_bytes() == (folder / n).read_bytes() for n in NEEDED)
        # an object overwritten after the pin: refused rather than mixed
        s3.put_object(Bucket="models", Key="smollm2/config.json", Body=b"{}")
        changed = run_as_kubelet(download_container(obj_s3, pins_s3), tmp_path / "other", secret, tmp_path / "tmp3")
        assert changed.returncode == 3 and "error: ObjectsChanged: s3://models/smollm2" in changed.stderr

    # --- hf:// GGUF file, per-pod cache: the init container fetches that one file
    obj_gguf = isvc({"uri": f"hf://{GGUF_REPO}/{gguf_name}", "credentialsSecret": "store-secret"},
                    {"emptyDir": {"sizeLimit": "1Gi"}})
    pins_gguf = pinned(obj_gguf)
    done = run_as_kubelet(download_container(obj_gguf, pins_gguf), volume, {"HF_TOKEN": TOKEN}, tmp_path / "tmp4")
    assert done.returncode == 0, done.stderr
    assert served_files(volume / "hf" / GGUF_REPO / pins_gguf[obj_gguf["spec"]["model"]["uri"]].revision) == {gguf_name}

    # --- kvfleet-server serves both results, started with the rendered arguments
    answer = serve_and_ask(obj, pins, volume, chat=True)
    assert answer.strip()
    assert serve_and_ask(obj_gguf, pins_gguf, volume, chat=False).strip()
