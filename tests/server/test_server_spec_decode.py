"""kvfleet-server with --speculative-config (issue 10), a real subprocess on the tiny random-weight Llama
and the official openai client: concurrent greedy / random / n > 1 / streaming requests complete with their
exact max_tokens, /metrics exports vLLM's spec_decode counters consistently with the generation counters,
and SIGTERM drains cleanly (exit 0)."""

import asyncio

import openai

from server_fixtures import scrape, start_server

ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", "2000000", "--max-num-seqs", "8",
        "--served-model-name", "tiny", "--shutdown-timeout", "10",
        "--speculative-config",  # min_acceptance 0: always draft (on the tiny model a draft costs about a full step)
        '{"method":"layer_skip","num_draft_layers":1,"num_speculative_tokens":3,"min_acceptance":0}']


def test_speculative_server_end_to_end(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, *ARGS], str(tmp_path / "server.log"))
    try:
        before = scrape(srv.url)
        assert before["vllm:spec_decode_num_drafts_total{}"] == 0
        assert {f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={j}}}" for j in range(3)} <= set(before)

        async def go():
            c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            kinds = [dict(temperature=0), dict(temperature=0.9, seed=3), dict(temperature=0.7, n=2),
                     dict(temperature=0, top_p=0.5)]
            calls = [c.completions.create(model="tiny", prompt=f"spec {i} " * 6, max_tokens=40,
                                          extra_body={"ignore_eos": True}, **kinds[i % 4]) for i in range(8)]
            stream = await c.completions.create(model="tiny", prompt="stream " * 5, max_tokens=30, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True})
            streamed = "".join([ch.choices[0].text async for ch in stream])
            return await asyncio.gather(*calls), streamed

        outs, streamed = asyncio.run(go())
        assert all(ch.finish_reason == "length" for o in outs for ch in o.choices)
        assert sum(o.usage.completion_tokens for o in outs) == 40 * 10  # 8 requests, two of them n=2
        after = scrape(srv.url)
        d = {k: after[k] - before.get(k, 0) for k in after if k.startswith("vllm:")}
        assert d["vllm:generation_tokens_total{}"] == 40 * 10 + 30
        drafts, drafted = d["vllm:spec_decode_num_drafts_total{}"], d["vllm:spec_decode_num_draft_tokens_total{}"]
        accepted = d["vllm:spec_decode_num_accepted_tokens_total{}"]
        per_pos = [d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={j}}}"] for j in range(3)]
        assert drafts > 0 and 0 <= accepted <= drafted <= 3 * drafts
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    finally:
        assert srv.stop() == 0, srv.log()
