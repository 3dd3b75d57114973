"""The one list of refusals (kvfleet_server.unsupported): every entry refused where a user meets it — at
start-up (exit 2, before the port is bound) and over HTTP (400, param = the field sent, code a string) —
and docs/server.md carries the table generated from it. A feature that lands deletes its entry."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvfleet_server import unsupported
from kvfleet_server.api import ServerSettings, ServerState, build_app
from kvfleet_server.api.protocol import ChatCompletionRequest, CompletionRequest
from kvfleet_server.flags import parse_flags
from kvfleet_server.errors import UnsupportedFeatureError

from server_fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
ENGINE = unsupported.ENGINE_REFUSALS
REQUEST = [(r, e) for r in unsupported.REQUEST_REFUSALS for e in r.endpoints]
# a value that asks for each request feature (the request's own shape)
ASKING = {"logit_bias": {"50": 5}, "bad_words": ["x"], "allowed_token_ids": [1, 2], "logits_processors": ["m.f"],
          "truncate_prompt_tokens": 3, "use_beam_search": True, "return_tokens_as_token_ids": True,
          "suffix": "end", "echo": True, "prompt_logprobs": 1,
          "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("refusal", ENGINE, ids=[r.flag for r in ENGINE])
def test_every_engine_refusal_is_refused_by_name_by_the_flag_check(refusal):
    with pytest.raises(UnsupportedFeatureError) as e:
        parse_flags(list(refusal.example))
    assert e.value.param == refusal.flag and str(e.value).startswith(f"not supported yet: {refusal.flag}")
    assert refusal.feature in str(e.value)


@pytest.mark.parametrize("refusal", ENGINE, ids=[r.flag for r in ENGINE])
def test_every_engine_refusal_stops_the_server_before_it_binds(refusal):
    # port 1 cannot be bound by this user: exit 2 with the message proves the check ran before binding
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.cli", "--port", "1", *refusal.example],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"error: not supported yet: {refusal.flag}" in out.stderr


def test_no_refusal_is_dropped_without_its_feature():
    # ASKING is this test's own list of request fields the API declares but does not implement: deleting an
    # entry from the server's list (as a merge once did with ``suffix``) must fail here, not silently accept it
    assert {r.field for r in unsupported.REQUEST_REFUSALS} == set(ASKING)


def test_engine_refusals_are_off_at_the_defaults():
    assert unsupported.engine_refusals(vars(parse_flags([]))) == []


@pytest.fixture(scope="module")
def client():
    state = ServerState(ServerSettings(served_model_names=["fake"]), engine=FakeEngine())
    with TestClient(build_app(state), raise_server_exceptions=False) as c:
        yield c


def _body(endpoint: str, **extra) -> dict:
    base = {"prompt": "x"} if endpoint == unsupported.COMPLETIONS else {"messages": [{"role": "user", "content": "x"}]}
    return {"model": "fake", "max_tokens": 1, **base, **extra}


@pytest.mark.parametrize("refusal, endpoint", REQUEST, ids=[f"{e}:{r.field}" for r, e in REQUEST])
def test_every_request_refusal_answers_400_naming_the_field(client, refusal, endpoint):
    model = CompletionRequest if endpoint == unsupported.COMPLETIONS else ChatCompletionRequest
    assert refusal.field in model.model_fields  # declared, so a request setting it is not silently ignored
    r = client.post(endpoint, json=_body(endpoint, **{refusal.field: ASKING[refusal.field]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {"message": refusal.message(), "type": "invalid_request_error", "param": refusal.field,
                   "code": "unsupported_parameter"}


@pytest.mark.parametrize("refusal, endpoint", REQUEST, ids=[f"{e}:{r.field}" for r, e in REQUEST])
def test_request_refusals_accept_the_fields_no_op_values(client, refusal, endpoint):
    model = CompletionRequest if endpoint == unsupported.COMPLETIONS else ChatCompletionRequest
    for value in (model.model_fields[refusal.field].default, *refusal.allowed):
        r = client.post(endpoint, json=_body(endpoint, **{refusal.field: value}))
        assert r.status_code == 200, (value, r.text)


def test_only_the_list_raises_not_supported_in_the_api():
    # the HTTP layer has no second copy: every "not supported yet" raised under api/ comes from the list
    # (or names a value the list cannot express: a content part type, best_of != n)
    found = set()
    for path in (ROOT / "serving_image/kvfleet_server/api").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "not supported yet:" in node.value:
                found.add((path.name, node.value.split("(")[0].strip()))
    assert found == {("convert.py", "not supported yet: best_of different from n"),
                     ("convert.py", "not supported yet: content part of type")}


def test_docs_carry_the_generated_table():
    doc = (ROOT / "docs/server.md").read_text()
    assert unsupported.markdown_table() in doc, "regenerate: python -m kvfleet_server.unsupported"
    out = subprocess.run([sys.executable, "-m", "kvfleet_server.unsupported"], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == unsupported.markdown_table()


def test_the_list_is_pure():
    # the operator image has no torch: importing the list (and the flag check) must not pull it in
    code = ("import sys, kvfleet_server.unsupported, kvfleet_server.flags; kvfleet_server.flags.parse_flags([]); "
            "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules, sorted(sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0
