"""Must-show 5: schemathesis against /openapi.json of a kvfleet-server subprocess (tiny Llama).

A few hundred generated cases, valid and invalid, over every public operation: never a 5xx, never a hang
(each call has a timeout), and the server still serves a normal request afterwards.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from server_fixtures import scrape, start_server

EXAMPLES = {GenerationMode.POSITIVE: 50, GenerationMode.NEGATIVE: 40}  # per POST operation; GETs have few inputs


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    srv = start_server(["--model", tiny_llama_dir, "--max-model-len", "64", "--kv-cache-memory-bytes", "4000000",
                        "--max-num-seqs", "16", "--served-model-name", "tiny", "--shutdown-timeout", "5",
                        "--disable-uvicorn-access-log"], str(tmp_path_factory.mktemp("fuzz") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


def test_no_5xx_and_no_hang_on_generated_requests(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models", "/health",
            "/metrics", "/version"} <= paths
    calls = {"n": 0}
    failures = []
    for op in operations:
        for mode, n in EXAMPLES.items():
            try:
                strategy = op.as_strategy(generation_mode=mode)
            except Exception:  # noqa: BLE001 - nothing negative to generate for parameterless GETs
                continue

            @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=strategy)
            def run(case):
                calls["n"] += 1
                resp = case.call(base_url=server.url, timeout=60)
                if resp.status_code >= 500:
                    failures.append((op.method, op.path, resp.status_code, resp.text[:300], case.body))
                assert resp.status_code < 500

            try:
                run()
            except AssertionError:
                pass  # recorded in failures
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # a GET without parameters has no invalid input
    assert not failures, failures[:3]
    assert calls["n"] >= 300
    ok = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "still fine", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    m = scrape(server.url)
    assert m["vllm:num_requests_running{}"] == 0 and m["kvfleet:kv_cache_blocks_free{}"] == m["kvfleet:kv_cache_blocks_total{}"]
    assert "Traceback" not in server.log()
