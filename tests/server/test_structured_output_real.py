"""Structured output and tool calls on the real SmolLM2-135M-Instruct through the official ``openai`` client
(kvfleet-server subprocess on 127.0.0.1): 50 JSON schemas × greedy and temperature 1 validate with
jsonschema; regex, choice and json_object outputs match; required and named tool calls for 10 tool sets
give arguments valid against the parameters; streamed tool-call deltas equal the non-streamed arguments."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from server_fixtures import openai_client, running_server, scrape
from structured_schemas import make_schemas

pytestmark = pytest.mark.slow
SCHEMAS = make_schemas(50)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--model", "smollm2", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--shutdown-timeout", "5"],
                        str(tmp_path_factory.mktemp("so_real") / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _pmap(fn, items):
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_50_json_schemas_validate(client, temperature):
    def one(item):
        i, (prompt, schema) = item
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=200,
            temperature=temperature, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return r.choices[0]

    choices = _pmap(one, list(enumerate(SCHEMAS)))
    for (prompt, schema), ch in zip(SCHEMAS, choices):
        assert ch.finish_reason == "stop", (ch.finish_reason, ch.message.content)
        jsonschema.validate(json.loads(ch.message.content), schema)


def test_regex_choice_and_json_object(client):
    msgs = [{"role": "user", "content": "Give me a product code and say whether you like it."}]
    for t in (0.0, 1.0):
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=20,
                                           temperature=t, seed=7,
                                           extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{4}"}})
        assert re.fullmatch(r"[A-Z]{3}-\d{4}", r.choices[0].message.content)
        r = client.completions.create(model="smollm2", prompt="Do you like it? Answer:", max_tokens=10,
                                      temperature=t, seed=7,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no", "not sure"]}})
        assert r.choices[0].text in ("yes", "no", "not sure")
        r = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=150,
                                           temperature=t, seed=7, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def _tool_sets():
    s = lambda n=10: {"type": "string", "maxLength": n}  # noqa: E731
    units = {"type": "string", "enum": ["celsius", "fahrenheit"]}
    fns = [
        ("get_weather", {"city": s(), "unit": units}, ["city", "unit"]),
        ("book_table", {"restaurant": s(), "people": {"type": "integer", "minimum": 1, "maximum": 12}},
         ["restaurant", "people"]),
        ("convert_currency", {"amount": {"type": "number", "minimum": 0, "maximum": 1000},
                              "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["amount", "to"]),
        ("search_web", {"query": s(20), "max_results": {"type": "integer", "minimum": 1, "maximum": 5}}, ["query"]),
        ("send_email", {"to": s(), "subject": s(12), "urgent": {"type": "boolean"}}, ["to", "subject"]),
        ("set_alarm", {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                       "minute": {"type": "integer", "minimum": 0, "maximum": 59}}, ["hour", "minute"]),
        ("add_todo", {"items": {"type": "array", "items": s(8), "minItems": 1, "maxItems": 2}}, ["items"]),
        ("play_music", {"artist": s(), "genre": {"type": "string", "enum": ["rock", "jazz", "pop"]}}, ["genre"]),
        ("get_stock", {"ticker": {"type": "string", "pattern": "^[A-Z]{1,4}$"}}, ["ticker"]),
        ("create_event", {"title": s(), "where": {"type": "object", "properties": {"city": s(), "room": {
            "type": "integer", "minimum": 1, "maximum": 99}}, "required": ["city", "room"],
            "additionalProperties": False}}, ["title", "where"]),
    ]
    tool = lambda n, p, r: {"type": "function", "function": {  # noqa: E731
        "name": n, "description": n.replace("_", " "),
        "parameters": {"type": "object", "properties": p, "required": r, "additionalProperties": False}}}
    tools = [tool(*f) for f in fns]
    # 10 tool sets: the i-th function with one or two others
    return [[tools[i], tools[(i + 1) % 10]] + ([tools[(i + 5) % 10]] if i % 2 else []) for i in range(10)]


TOOL_SETS = _tool_sets()
ASK = "Please use a tool for this: {}."


def _params(tools, name):
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


@pytest.mark.parametrize("mode", ["required", "named"])
def test_tool_calls_validate_for_10_tool_sets(client, mode):
    def one(tools):
        target = tools[0]["function"]["name"]
        choice = "required" if mode == "required" else {"type": "function", "function": {"name": target}}
        r = client.chat.completions.create(
            model="smollm2", max_tokens=200, temperature=0, tools=tools, tool_choice=choice,
            messages=[{"role": "user", "content": ASK.format(target.replace("_", " "))}])
        return r.choices[0]

    for tools, ch in zip(TOOL_SETS, _pmap(one, TOOL_SETS)):
        assert ch.finish_reason == "tool_calls", ch
        calls = ch.message.tool_calls
        assert calls and all(c.id and c.type == "function" for c in calls)
        if mode == "named":
            assert [c.function.name for c in calls] == [tools[0]["function"]["name"]]
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), _params(tools, c.function.name))


@pytest.mark.parametrize("mode", ["required", "named"])
def test_streamed_tool_call_arguments_equal_non_streamed(client, mode):
    for tools in TOOL_SETS[:2]:
        target = tools[0]["function"]["name"]
        kw = dict(model="smollm2", max_tokens=200, temperature=0, tools=tools,
                  tool_choice="required" if mode == "required" else {"type": "function", "function": {"name": target}},
                  messages=[{"role": "user", "content": ASK.format(target.replace("_", " "))}])
        full = client.chat.completions.create(**kw).choices[0].message.tool_calls
        args: dict[int, str] = {}
        names: dict[int, str] = {}
        reasons = []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
                    if tc.function.name:
                        names[tc.index] = tc.function.name
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        assert [args[i] for i in sorted(args)] == [c.function.arguments for c in full]
        assert [names[i] for i in sorted(names)] == [c.function.name for c in full]
        assert reasons == ["tool_calls"]


def test_structured_output_metrics(server, client):
    m = scrape(server.url)
    assert m["kvfleet:structured_output_requests_total{kind=json}"] >= 100
    assert m["kvfleet:structured_output_compile_seconds_count{}"] >= 100
