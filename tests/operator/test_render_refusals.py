"""Must-show 4 of issue 17: every "not supported yet" refusal of kvfleet-server has its render-time twin.

The test enumerates the server's own list (kvfleet_server.unsupported.ENGINE_REFUSALS) and renders an
InferenceService for each entry — through the spec field that renders the flag, or through extraArgs for a
flag no field renders — and expects render to refuse it (UnsupportedFeature, naming the field, one line)
instead of creating pods that would exit 2 at start. A new entry without a spec here fails the test."""

import pytest

from kvfleet_operator import api, render
from kvfleet_server import unsupported

HF = {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}}
# the spec that makes render emit each refused flag, by flag (flags no spec field renders go in extraArgs)
SPEC_FOR_FLAG = {
    "--speculative-config": {**HF, "engine": {"speculative": {"method": "eagle3", "numSpeculativeTokens": 4,
                                                              "draftModel": "hf://a/eagle3-head"}}},
    "--dtype": {**HF, "engine": {"dtype": "float16"}, "resources": {"gpus": 0}},
}
# refused values the CRD's schema itself excludes (the speculative method enum lists exactly the server's built
# methods, tests/operator/test_operator_render.py::test_crd_methods_follow_the_server): parsing the spec refuses
# them, naming the field and the server's refusal
SCHEMA_EXCLUDED = {"--speculative-config"}


def isvc(spec: dict) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "m", "namespace": "ns"},
            "spec": spec}


def _spec(refusal: unsupported.EngineRefusal) -> tuple[dict, str]:
    if refusal.flag in api.RENDERED_FLAGS:
        assert refusal.flag in SPEC_FOR_FLAG, f"add the spec that renders {refusal.flag} to SPEC_FOR_FLAG"
        return SPEC_FOR_FLAG[refusal.flag], api.RENDERED_FLAGS[refusal.flag]
    return {**HF, "engine": {"extraArgs": list(refusal.example)}}, "spec.engine.extraArgs"


@pytest.mark.parametrize("refusal", unsupported.ENGINE_REFUSALS, ids=[r.flag for r in unsupported.ENGINE_REFUSALS])
def test_every_server_refusal_is_refused_at_render(refusal):
    spec, field = _spec(refusal)
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc(spec))
    if refusal.flag in SCHEMA_EXCLUDED:
        assert err.value.reason == "InvalidSpec" and err.value.message.startswith(f"{field}.")
    else:
        assert err.value.reason == "UnsupportedFeature" and err.value.message.startswith(f"{field}: ")
    assert f"not supported yet: {refusal.flag}" in err.value.message
    assert "\n" not in err.value.message


def test_the_refusals_come_from_the_servers_list(features_landed):
    # with the list emptied (the features landed), the same specs render: render keeps no second copy
    for flag, spec in SPEC_FOR_FLAG.items():
        if flag not in SCHEMA_EXCLUDED:
            render.render(isvc(spec))


def test_extra_args_the_server_would_not_parse_are_refused_at_render():
    for args, text in ((["--swap-space", "4"], "unrecognized arguments: --swap-space"),
                       (["--max-num-seqs", "0"], "--max-num-seqs"),
                       (["--speculative-config", "{bad"], "--speculative-config")):
        with pytest.raises(render.Unrealisable) as err:
            render.render(isvc({**HF, "engine": {"extraArgs": args}}))
        assert err.value.message.startswith("spec.engine.extraArgs: ") and text in err.value.message
        assert err.value.reason in ("InvalidExtraArgs", "InvalidSpec")


def test_cpu_pods_get_num_threads_from_the_cpu_request():
    def threads(spec):
        args = render.render(isvc(spec)).deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--num-threads") + 1] if "--num-threads" in args else None

    cpu = {"model": {"uri": "bundled://smollm2"}, "resources": {"gpus": 0}}
    assert threads({**cpu, "resources": {"gpus": 0, "cpu": 1}}) == "1"
    assert threads({**cpu, "resources": {"gpus": 0, "cpu": "500m"}}) == "1"
    assert threads({**cpu, "resources": {"gpus": 0, "cpu": "4"}}) == "4"  # the server's rule: every CPU
    assert threads({**cpu, "resources": {"gpus": 0, "cpu": "2500m"}}) == "2"  # rounded down
    assert threads(cpu) is None  # no request: the server reads its cgroup limit and affinity itself
    assert threads({**HF, "resources": {"cpu": "8"}}) is None  # GPU pods
    with pytest.raises(render.Unrealisable) as err:
        render.render(isvc({**cpu, "engine": {"extraArgs": ["--num-threads", "9"]}}))
    assert "spec.resources.cpu" in err.value.message


def test_termination_message_reaches_status():
    c = render.render(isvc(HF)).deployment["spec"]["template"]["spec"]["containers"][0]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize("content, text", [(None, "No such file or directory"), ("a: [b\n", "not YAML"),
                                           ("model: {}\n", "expected apiVersion")])
def test_render_errors_are_one_line(tmp_path, capsys, content, text):
    from kvfleet_operator import cli

    path = tmp_path / "x.yaml"
    if content is not None:
        path.write_text(content)
    assert cli.main(["render", str(path if content is not None else tmp_path / "nonexistent.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and text in err, err


def test_a_refused_spec_renders_one_line_naming_the_field(tmp_path, capsys):
    import yaml

    from kvfleet_operator import cli

    (tmp_path / "f16.yaml").write_text(yaml.safe_dump(isvc(SPEC_FOR_FLAG["--dtype"])))
    assert cli.main(["render", str(tmp_path / "f16.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: m: UnsupportedFeature: spec.engine.dtype: ") and "not supported yet" in err
