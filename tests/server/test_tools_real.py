"""OpenAI tools on real kvfleet-server processes: the tools reach the prompt the model sees (both for a
chat template without a tools section, where they go into the system message, and for one that renders
``tools`` itself), and ``tool_choice: auto`` on the real SmolLM2 turns the model's hermes-style call into
``tool_calls`` while plain answers stay content."""
from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import openai_client, running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "What is the weather in London?"}]
# a template with its own tools section (as Llama 3.1's or Qwen2.5's): the server passes tools to it
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}="
    "{{ t['function']['description'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _prompt(url: str, body: dict) -> str:
    """The text of the prompt the server builds for a chat body (its render endpoint, then /detokenize)."""
    rendered = httpx.post(url + "/v1/chat/completions/render", json=body, timeout=60)
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["token_ids"]
    return httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


@pytest.fixture(scope="module")
def smol(gguf_path, tmp_path_factory):
    args = ["--model", gguf_path, "--served-model-name", "smol", "--device", "cpu", "--num-threads", "1",
            "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with running_server(args, str(tmp_path_factory.mktemp("smol") / "server.log")) as srv:
        yield srv


def test_tools_go_into_the_system_message_of_a_template_without_them(smol):
    """SmolLM2's template has no tools section: the tools, as JSON, are written into the system message."""
    with_tools = _prompt(smol.url, {"model": "smol", "messages": USER, "tools": [WEATHER]})
    without = _prompt(smol.url, {"model": "smol", "messages": USER})
    assert json.dumps(WEATHER) in with_tools and "<tools>" in with_tools
    assert "get_weather" not in without
    assert with_tools.endswith("What is the weather in London?\nassistant\n")
    # tool_choice "none" still shows the tools to the model (vLLM's default)
    assert json.dumps(WEATHER) in _prompt(smol.url, {"model": "smol", "messages": USER, "tools": [WEATHER],
                                                    "tool_choice": "none"})


def test_a_template_with_a_tools_section_receives_them(tiny_llama_dir, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    args = ["--model", tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
            "--num-threads", "1", "--chat-template", str(template)]
    with running_server(args, str(tmp_path / "server.log")) as srv:
        # (tool_choice none: this server has no tool-call parser; the tools are still shown to the model)
        prompt = _prompt(srv.url, {"model": "tiny", "messages": USER, "tools": [WEATHER], "tool_choice": "none"})
        assert "TOOLS: get_weather=Get the current weather in a city" in prompt
        assert "<tools>" not in prompt  # the template's own section, not the system-message fallback
        assert "TOOLS:" not in _prompt(srv.url, {"model": "tiny", "messages": USER})


def test_auto_tool_choice_on_the_real_model(smol):
    """With one example call in the conversation, greedy SmolLM2 answers new questions with a hermes
    ``<tool_call>``: the server returns it as ``tool_calls`` (arguments as a JSON string) and
    finish_reason "tool_calls"; a question the tool does not fit stays plain content."""
    client = openai_client(smol)
    shot = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant",
             "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}]
    for city in ("London", "Tokyo"):
        r = client.chat.completions.create(
            model="smol", messages=shot + [{"role": "user", "content": f"What is the weather in {city}?"}],
            tools=[WEATHER], temperature=0, max_tokens=60)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": city} and call.id.startswith("chatcmpl-tool-")
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Tell me a joke."}],
                                       tools=[WEATHER], temperature=0, max_tokens=20)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content
