"""The pure pieces of model weights, and kvfleet-download against the fake Hub with a tiny repository (fast)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvfleet_operator import model_status, weights
from kvfleet_operator.model_source import parse
from kvfleet_server import download, model_files

INDEX = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                   "b": "model-00002-of-00002.safetensors"}}).encode()
TINY = {"config.json": b"{}", "generation_config.json": b"{}", "tokenizer.json": b"{}", "tokenizer_config.json": b"{}",
        "chat_template.jinja": b"{{ messages }}", "model.safetensors.index.json": INDEX,
        "model-00001-of-00002.safetensors": b"1" * 1000, "model-00002-of-00002.safetensors": b"2" * 2000,
        "consolidated.safetensors": b"c" * 3000, "original/consolidated.00.pth": b"p" * 5000,
        "original/tokenizer.model": b"t", "pytorch_model.bin": b"b" * 100, "README.md": b"#", "gguf/m-Q4_0.gguf": b"g"}
NEEDED = ["chat_template.jinja", "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
          "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]


def test_select_takes_what_serving_reads_and_nothing_else():
    names = list(TINY)
    weights_of_index = json.loads(INDEX)["weight_map"].values()
    assert model_files.select(names, index_weight_files=weights_of_index) == NEEDED
    assert "consolidated.safetensors" in model_files.select(names)  # without the index: every top-level shard
    assert model_files.select(names, "tokenizer") == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert model_files.select(names, gguf_file="gguf/m-Q4_0.gguf") == ["gguf/m-Q4_0.gguf"]
    with pytest.raises(model_files.FileMissing, match=r"no file 'x.gguf' there; .gguf files present: gguf/m-Q4_0"):
        model_files.select(names, gguf_file="x.gguf")
    with pytest.raises(model_files.NothingToServe, match=r"no safetensors weights .*found \.bin, \.pth"):
        model_files.select(["config.json", "pytorch_model.bin", "original/x.pth"])


def test_s3_revision_changes_with_any_object():
    base = {"a": '"e1"', "b": '"e2"'}
    assert model_files.s3_revision(base) == model_files.s3_revision({"b": "e2", "a": "e1"})  # quotes, order
    for other in ({**base, "a": '"e3"'}, {**base, "c": '"e4"'}, {"a": '"e1"'}):
        assert model_files.s3_revision(other) != model_files.s3_revision(base)


def test_downloader_errors_name_a_reason_and_tell_permanent_from_transient():
    from botocore.exceptions import ClientError, NoCredentialsError

    def boto(code):
        return ClientError({"Error": {"Code": code}}, "ListObjectsV2")
    assert download.classify(boto("NoSuchBucket"), "s3://b").reason == "BucketNotFound"
    assert download.classify(boto("AccessDenied"), "s3://b").reason == "Unauthorized"
    assert download.classify(NoCredentialsError(), "s3://b").reason == "Unauthorized"
    assert download.classify(OSError(28, "No space left on device"), "x").reason == "DiskFull"
    slow = download.classify(ConnectionResetError("reset"), "x")
    assert slow.reason == "Unreachable" and not slow.permanent


def test_a_failed_download_names_the_field_to_fix():
    from kvfleet_operator import api

    spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://o/r"},
                                                    "modelCache": {"emptyDir": {"sizeLimit": "1Gi"}}})
    src = parse("hf://o/r", "spec.model.uri")
    assert model_status.failure("error: RepositoryNotFound: hf://o/r@main: repository not found", src, spec) == \
        ("RepositoryNotFound", "spec.model.uri: hf://o/r@main: repository not found")
    assert model_status.failure("error: DiskFull: hf://o/r: no space", src, spec)[1].startswith(
        "spec.modelCache.emptyDir.sizeLimit: ")
    assert model_status.failure("error: Unauthorized: hf://o/r: gated", src, spec)[1].startswith(
        "spec.model.credentialsSecret: ")
    assert model_status.failure("Traceback ...", src, spec) is None


def test_model_ready_reads_downloading_loading_ready():
    src = parse("hf://o/r", "spec.model.uri")
    busy = model_status.Download(src, "a" * 40, "running", "job j", 3 * 2**30, 12 * 2**30)
    assert model_status.condition([busy], [], False, "a" * 40) == \
        (False, "Downloading", f"hf://o/r@{'a' * 12}: 3.0 GiB of 12.0 GiB (25%)")
    done = model_status.Download(src, "a" * 40, "succeeded", "job j")
    pending_pod = {"metadata": {"name": "p"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}
    assert model_status.condition([done], [pending_pod], False, "a" * 40) == \
        (False, "Loading", f"weights in place at {'a' * 12}; pod p: waiting for a node (Unschedulable)")
    assert model_status.condition([done], [], True, "a" * 40) == (True, "Ready", f"the model at {'a' * 12} is served")


def test_job_state_and_progress_parsing():
    assert weights.job_state({}) == "pending"
    assert weights.job_state({"status": {"active": 1}}) == "running"
    assert weights.job_state({"status": {"succeeded": 1}}) == "succeeded"
    assert weights.job_state({"status": {"conditions": [{"type": "Failed", "status": "True"}]}}) == "failed"
    text = f"# TYPE {download.DOWNLOADED} gauge\n{download.DOWNLOADED} 5.0\n# TYPE {download.EXPECTED} gauge\n" \
           f"{download.EXPECTED} 10.0\n"
    assert weights.parse_progress(text) == (5.0, 10.0)
    assert weights.parse_progress("") == (None, None)


def test_prune_keeps_the_served_and_the_fetched_revision(tmp_path):
    for rev in ("old", "served", "new"):
        (tmp_path / rev).mkdir()
        (tmp_path / rev / "f").write_bytes(b"x" * 10)
    assert download.prune(str(tmp_path / "new"), ["served"]) == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "served"]
    assert download.bytes_on_disk(str(tmp_path)) >= 0


def test_the_downloader_ignores_hf_hub_offline_and_fetches_the_pinned_commit(fake_hub, tmp_path):
    """kvfleet-download as a process, HF_HUB_OFFLINE=1 in its environment (a serving setting of engine.env):
    the pinned commit's needed files arrive; the decoys and the later commit are never asked for."""
    c1 = fake_hub.commit("tiny/units", TINY)
    fake_hub.commit("tiny/units", {**TINY, "config.json": b'{"v": 2}'})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": str(tmp_path)}
    dest = tmp_path / "models" / c1
    run = subprocess.run([sys.executable, "-m", "kvfleet_server.download", "hf", "tiny/units", "--revision", c1,
                          "--dest", str(dest), "--endpoint", os.environ["HF_ENDPOINT"]], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in dest.iterdir() if p.is_file()) == NEEDED
    assert (dest / "config.json").read_bytes() == b"{}"
    for decoy in ("consolidated.safetensors", "original/consolidated.00.pth", "pytorch_model.bin", "README.md"):
        assert not fake_hub.fetched(decoy), decoy
    missing = subprocess.run([sys.executable, "-m", "kvfleet_server.download", "hf", "tiny/units", "--revision", c1,
                              "--dest", str(tmp_path / "g"), "--file", "m.gguf", "--endpoint",
                              os.environ["HF_ENDPOINT"]], env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 3
    assert missing.stderr.strip().splitlines()[-1] == \
        f"error: FileNotFound: hf://tiny/units@{c1}: no file 'm.gguf' there; .gguf files present: gguf/m-Q4_0.gguf"
