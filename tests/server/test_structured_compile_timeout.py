"""Structured-output refusals on a real kvfleet-server (tiny random-weight Llama, real engine + xgrammar):
a refused schema feature and a refused regex feature are 400s naming the field; a pathological schema hits
the compile timeout (400) while another stream keeps getting tokens (its inter-token gaps measured before
and during the compile); the server stays healthy and counts the rejections; jump-forward's counter."""

import json
import statistics
import threading
import time

import httpx
import pytest

from server_fixtures import scrape, start_server

ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "4000000", "--max-num-seqs", "8",
        "--served-model-name", "tiny", "--shutdown-timeout", "5",
        "--structured-outputs-config", json.dumps({"compile_timeout": 0.5, "disable_any_whitespace": True}),
        "--enable-jump-forward"]
# compile time grows superlinearly with the property count (xgrammar 0.2.9, measured on an idle core:
# 150 properties 0.07 s, 600 1.4 s, 1500 16 s): 800 string properties with a pattern take seconds even on an
# idle machine, far over the 0.5 s compile_timeout, whatever the load
PATHOLOGICAL = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,20}"}
                                                 for i in range(800)}}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = start_server(["--model", tiny_llama_dir, *ARGS], str(tmp_path_factory.mktemp("so") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


def _post(server, body):
    return httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 8, **body},
                      timeout=60)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", ["uniqueItems"]),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"not": {"type": "null"}}}}}},
     "structured_outputs.json", ["'not'", "properties.a.not"]),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", ["Lookahead"]),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", ["foo"]),
])
def test_refused_features_are_400_naming_the_field(server, body, param, words):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert all(w in err["message"] for w in words), err["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_constrained_output_on_the_tiny_model(server):
    r = _post(server, {"structured_outputs": {"choice": ["alpha", "beta"]}, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("alpha", "beta")


def test_jump_forward_is_counted(server):
    schema = {"type": "object", "properties": {"first_answer": {"type": "boolean"},
                                               "second_answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["first_answer", "second_answer"], "additionalProperties": False}
    before = scrape(server.url).get("kvfleet:jump_forward_tokens_total{}", 0)
    r = _post(server, {"structured_outputs": {"json": schema}, "max_tokens": 40})
    assert r.status_code == 200
    doc = json.loads(r.json()["choices"][0]["text"])
    assert set(doc) == {"first_answer", "second_answer"} and doc["second_answer"] in ("yes", "no")
    assert scrape(server.url)["kvfleet:jump_forward_tokens_total{}"] > before


def test_pathological_schema_hits_the_timeout_without_stalling_other_streams(server):
    arrivals: list[float] = []
    started = threading.Event()

    def stream():
        body = {"model": "tiny", "prompt": "hello " * 20, "max_tokens": 600, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 20:
                        started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    time.sleep(0.5)
    t0 = time.monotonic()
    r = _post(server, {"response_format": {"type": "json_schema",
                                           "json_schema": {"name": "big", "schema": PATHOLOGICAL}}})
    t1 = time.monotonic()
    t.join()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "compile_timeout" in err["message"]

    def gaps(lo, hi):
        ts = [a for a in arrivals if lo <= a <= hi]
        return [b - a for a, b in zip(ts, ts[1:])]

    before, during = gaps(t0 - (t1 - t0) - 0.5, t0), gaps(t0, t1)
    print(f"\nITL of the other stream: before median {statistics.median(before) * 1e3:.1f} ms "
          f"(n={len(before)}), during the {t1 - t0:.2f} s compile wait median "
          f"{statistics.median(during) * 1e3:.1f} ms max {max(during) * 1e3:.1f} ms (n={len(during)})")
    assert len(during) >= 3, "the other stream got no tokens while the grammar compiled"
    assert len(arrivals) > 500  # it ran to the end
    m = scrape(server.url)
    assert m["kvfleet:structured_output_rejections_total{reason=compile_timeout}"] == 1
    assert m["kvfleet:structured_output_rejections_total{reason=unsupported_feature}"] >= 3
    assert httpx.get(server.url + "/health").status_code == 200
    ok = _post(server, {"structured_outputs": {"choice": ["x", "y"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("x", "y")
