"""Must-show 1: the official ``openai`` client against kvfleet-server (subprocess, 127.0.0.1) on the real
SmolLM2-135M-Instruct model: completions, chat, streaming (greedy deltas == non-streamed text),
logprobs, n = 2, stop, usage, stream_options.include_usage."""

import httpx
import openai
import pytest

from server_fixtures import start_server

pytestmark = pytest.mark.slow
MSG = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(["--model", "smollm2", "--max-model-len", "1024", "--max-num-seqs", "8",
                        "--shutdown-timeout", "5"], str(tmp_path_factory.mktemp("real") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_max_model_len(server, client, model):
    assert model == "smollm2"  # vLLM's rule: the --model string
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 1024


def test_chat_answers_sensibly(client, model):
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=32, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_equals_non_streamed_for_greedy(client, model):
    full = client.chat.completions.create(model=model, messages=MSG, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=MSG, max_tokens=40, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # include_usage not asked


def test_include_usage_only_in_final_chunk(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=MSG, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    empty = list(client.chat.completions.create(model=model, messages=MSG, max_tokens=8, temperature=0, stream=True,
                                                stream_options={}))
    assert all(c.usage is None for c in empty) and empty[-1].choices


def test_completions_usage_echo_and_token_prompt(server, client, model):
    prompt = "The three primary colors are"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    count = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert r.usage.prompt_tokens == count and r.usage.completion_tokens == 10
    assert r.choices[0].finish_reason == "length"
    echo = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + r.choices[0].text
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    two = client.completions.create(model=model, prompt=[prompt, "Once upon a time"], max_tokens=4, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == r.choices[0].text[:len(two.choices[0].text)]


def test_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy picks the top one
    assert "".join(e.token for e in content) == r.choices[0].message.content
    alone = client.chat.completions.create(model=model, messages=MSG, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in alone.choices[0].logprobs.content)
    c = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text and all(len(t) >= 2 for t in lp.top_logprobs)
    e = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=3, temperature=0, logprobs=1,
                                  echo=True)
    elp = e.choices[0].logprobs
    assert e.choices[0].text.startswith("Hello, my name is") and elp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert len(elp.tokens) == e.usage.prompt_tokens + 3
    assert elp.text_offset[e.usage.prompt_tokens] == len("Hello, my name is")


def test_n_2(client, model):
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=12, n=2, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 24
    chunks = list(client.chat.completions.create(model=model, messages=MSG, max_tokens=12, n=2, temperature=1.0,
                                                 seed=7, stream=True))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in r.choices}  # same seed, same samples


def test_stop_string(client, model):
    base = client.chat.completions.create(model=model, messages=MSG, max_tokens=32, temperature=0)
    text = base.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = text[: text.index(stop)]
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=32, temperature=0, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=model, messages=MSG, max_tokens=32, temperature=0, stop=[stop],
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut  # never partly streamed
