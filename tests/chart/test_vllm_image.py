"""The chart's vllmImage reaches the operator (KVFLEET_VLLM_IMAGE) and is the image it renders for
InferenceServices with `spec.engine.runtime: vllm` (issue 34)."""
from __future__ import annotations

import copy

import pytest
import yaml

from .conftest import CHART, HelmError, render_chart


def _env(manifests) -> dict[str, str]:
    (dep,) = [m for m in manifests if m["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in c["env"]}


def test_vllm_image_reaches_the_operator_and_the_pods_it_renders(rendered_default, rendered_all):
    from kvfleet_operator import render

    values = yaml.safe_load((CHART / "values.yaml").read_text())["vllmImage"]
    env = _env(rendered_default)
    assert env["KVFLEET_VLLM_IMAGE"] == f"{values['repository']}:{values['tag']}"
    assert _env(rendered_all)["KVFLEET_VLLM_IMAGE"] == "registry.example.com/mirror/vllm-openai:v0.23.1"
    sample = yaml.safe_load((CHART.parents[1] / "crds/samples/llama-3.1-8b-instruct.yaml").read_text())
    vllm = copy.deepcopy(sample)
    vllm["spec"]["engine"]["runtime"] = "vllm"
    defaults = render.ServingDefaults.from_env(env)
    for obj, image in ((vllm, env["KVFLEET_VLLM_IMAGE"]), (sample, env["KVFLEET_SERVING_IMAGE"])):
        box = render.render(obj, defaults=defaults).deployment["spec"]["template"]["spec"]["containers"][0]
        assert (box["image"], box["imagePullPolicy"]) == (image, "IfNotPresent")


@pytest.mark.parametrize("sets", [["vllmImage.tag="], ["vllmImage.digest=sha256:0"]])
def test_schema_refuses_a_bad_vllm_image(helm, sets):
    with pytest.raises(HelmError, match="vllmImage"):
        render_chart(helm, sets=sets)
