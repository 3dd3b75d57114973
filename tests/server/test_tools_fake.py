"""Tool calling over the HTTP layer with a scripted fake engine (in-process), and the Hermes parser itself:
auto extracts calls from the model's text and passes plain text through, streamed tool-call deltas
concatenate to the non-streamed arguments, and bad tool / structured-output input is a 400 naming the field."""

import json

import pytest
from fastapi.testclient import TestClient

from kvfleet_server.api import ServerSettings, ServerState, build_app
from kvfleet_server.api.tool_parser import HermesToolParser
from kvfleet_server.api.tools import ChatToolStream, RequiredCallStreamer, ToolPlan, calls_from_output

from server_fake_engine import FakeEngine

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
SCRIPT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome, \\"IT\\""}}\n</tool_call>#')


def _client(text, **settings):
    state = ServerState(ServerSettings(served_model_names=["fake"], **settings),
                        engine=FakeEngine(max_model_len=2048, text=text))
    return TestClient(build_app(state), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def auto_client():
    with _client(SCRIPT, enable_auto_tool_choice=True, tool_call_parser="hermes") as c:
        yield c


def _body(**kw):
    return {"messages": [{"role": "user", "content": "weather in Paris and Rome?"}], "tools": [WEATHER],
            "max_tokens": 300, "stop": ["#"], **kw}


def test_auto_extracts_calls_from_scripted_output(auto_client):
    r = auto_client.post("/v1/chat/completions", json=_body(tool_choice="auto"))
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["content"] == "Let me check."
    calls = ch["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": 'Rome, "IT"'}]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_auto_is_the_default_with_tools(auto_client):
    r = auto_client.post("/v1/chat/completions", json=_body())
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


def _stream(client, body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content, calls, reasons = "", {}, []
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = tc.get("id") or entry["id"]
                fn = tc.get("function") or {}
                entry["name"] = fn.get("name") or entry["name"]
                entry["arguments"] += fn.get("arguments") or ""
            if c["finish_reason"]:
                reasons.append(c["finish_reason"])
    return content, [calls[i] for i in sorted(calls)], reasons


def test_auto_streamed_deltas_concatenate_to_the_non_streamed_arguments(auto_client):
    full = auto_client.post("/v1/chat/completions", json=_body()).json()["choices"][0]["message"]
    content, calls, reasons = _stream(auto_client, _body())
    assert content == full["content"]
    assert [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in full["tool_calls"]]
    assert [c["name"] for c in calls] == ["get_weather", "get_weather"] and all(c["id"] for c in calls)
    assert reasons == ["tool_calls"]


def test_auto_passes_plain_text_through():
    with _client("hello world #", enable_auto_tool_choice=True, tool_call_parser="hermes") as c:
        ch = c.post("/v1/chat/completions", json=_body()).json()["choices"][0]
        assert ch["message"]["content"] == "hello world " and ch["message"]["tool_calls"] == []
        assert ch["finish_reason"] == "stop"
        content, calls, reasons = _stream(c, _body())
        assert content == "hello world " and calls == [] and reasons == ["stop"]


def test_tool_choice_none_is_plain_text(auto_client):
    ch = auto_client.post("/v1/chat/completions", json=_body(tool_choice="none")).json()["choices"][0]
    assert ch["message"]["tool_calls"] == [] and "<tool_call>" in ch["message"]["content"]
    assert ch["finish_reason"] == "stop"


def _err(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_auto_without_the_flags_is_vllms_400():
    with _client(SCRIPT) as c:
        msg = _err(c.post("/v1/chat/completions", json=_body(tool_choice="auto")), "tool_choice")
        assert msg == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("body,param", [
    (_body(tool_choice={"type": "function", "function": {"name": "absent"}}), "tool_choice"),
    (_body(tool_choice="sometimes"), "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    (_body(tools=[{"type": "function", "function": {"name": ""}}]), "tools.0.function.name"),
    (_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     "tools.0.function.parameters"),
    (_body(tools=[WEATHER, WEATHER], tool_choice="required"), "tools.1.function.name"),
    (_body(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                          "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"structural_tag": "x"}},
     "structured_outputs.structural_tag"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"messages": [{"role": "user", "content": "x"}], "guided_json": "{not json"}, "guided_json"),
])
def test_bad_tool_and_structured_input_is_400_naming_the_field(auto_client, body, param):
    _err(auto_client.post("/v1/chat/completions", json=body), param)
    assert auto_client.get("/health").status_code == 200


def test_conflicting_fields_on_completions(auto_client):
    body = {"prompt": "x", "guided_regex": "a+", "structured_outputs": {"choice": ["a"]}}
    assert "conflicting" in _err(auto_client.post("/v1/completions", json=body), "guided_regex")


# ------------------------------------------------------------------ the parsers, pure


def test_hermes_streaming_equals_whole_text_at_every_split():
    whole = HermesToolParser.extract(SCRIPT[:-1])
    for cut in range(len(SCRIPT)):
        p = HermesToolParser()
        c1, k1 = p.feed(SCRIPT[:cut])
        c2, k2 = p.feed(SCRIPT[cut:-1])
        c3, _ = p.finish()
        assert (c1 + c2 + c3).strip() == whole[0]
        assert [(c.name, c.arguments) for c in k1 + k2] == [(c.name, c.arguments) for c in whole[1]]


def test_hermes_leaves_bad_blocks_and_unterminated_blocks_as_content():
    content, calls = HermesToolParser.extract("a <tool_call>{not json}</tool_call> b <tool_call>{\"name\": ")
    assert calls == [] and content == 'a <tool_call>{not json}</tool_call> b <tool_call>{"name": '


def test_required_streamer_matches_non_streamed_at_every_split():
    text = '[{"name": "f", "arguments": {"a": "}{\\"", "b": [1, {"c": 2}]}}, {"name": "g", "arguments": {}}]'
    plan = ToolPlan("required", [])
    _, whole = calls_from_output(plan, text)
    assert [c.name for c in whole] == ["f", "g"]
    for cut in range(len(text)):
        s = RequiredCallStreamer()
        got = s.feed(text[:cut]) + s.feed(text[cut:])
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in whole]


def test_named_stream_sends_the_text_as_argument_deltas():
    ts = ChatToolStream(ToolPlan("named", [], name="f"))
    parts = ['{"a"', ': 1', "}"]
    deltas = [d for p in parts for d in ts.feed(p)[1]]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""} and deltas[0]["id"]
    assert "".join(d["function"]["arguments"] for d in deltas) == "".join(parts)
    assert calls_from_output(ToolPlan("named", [], name="f"), "".join(parts))[1][0].arguments == "".join(parts)
