"""Overload (must-show 3) and graceful drain on SIGTERM (must-show 4), each on its own kvfleet-server
subprocess with the tiny random-weight Llama."""

import asyncio
import json
import signal

import httpx

from server_fixtures import scrape, start_server

BASE = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "4000000", "--served-model-name", "tiny"]


def test_overload_excess_gets_429_health_stays_200(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, *BASE, "--max-num-seqs", "4", "--max-queue-len", "4"],
                       str(tmp_path / "server.log"))
    try:
        health = []

        async def go():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as c:
                async def probe():
                    while True:
                        health.append((await c.get(srv.url + "/health")).status_code)
                        await asyncio.sleep(0.05)

                prober = asyncio.create_task(probe())
                rs = await asyncio.gather(*[c.post(srv.url + "/v1/completions", json={
                    "model": "tiny", "prompt": f"load {i}", "max_tokens": 40, "ignore_eos": True}) for i in range(50)])
                prober.cancel()
                return rs

        rs = asyncio.run(go())
        codes = [r.status_code for r in rs]
        assert set(codes) == {200, 429}, codes
        rejected = [r for r in rs if r.status_code == 429]
        assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full" for r in rejected)
        accepted = [r.json() for r in rs if r.status_code == 200]
        assert len(accepted) >= 4  # at least the waiting queue's worth (more once some are running)
        assert all(a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == 40
                   for a in accepted)
        assert health and set(health) == {200}
        m = scrape(srv.url)
        assert m["vllm:admission_rejections_total{reason=queue_full}"] == len(rejected)
        assert m["vllm:request_success_total{finished_reason=length}"] == len(accepted)
    finally:
        assert srv.stop() == 0, srv.log()


def test_sigterm_drains_in_flight_streams_and_exits_0(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, *BASE, "--max-num-seqs", "8", "--shutdown-timeout", "60"],
                       str(tmp_path / "server.log"))
    try:
        async def stream(c, i, started: asyncio.Event, counter: list):
            finish, text, done = None, "", False
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 300,
                    "ignore_eos": True, "stream": True}
            async with c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    ch = json.loads(line[6:])["choices"][0]
                    text += ch["delta"].get("content") or ""
                    if ch["delta"].get("content") and not counter[i]:
                        counter[i] = 1
                        if sum(counter) == 8:
                            started.set()
                    finish = ch["finish_reason"] or finish
            return finish, done

        async def go():
            started = asyncio.Event()
            counter = [0] * 8
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=20)) as c:
                tasks = [asyncio.create_task(stream(c, i, started, counter)) for i in range(8)]
                await asyncio.wait_for(started.wait(), 60)
                assert scrape(srv.url)["vllm:num_requests_running{}"] == 8
                srv.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.1)  # let the signal handler run
                health = await c.get(srv.url + "/health")
                late = await c.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
                running = scrape(srv.url)["vllm:num_requests_running{}"]
                results = await asyncio.gather(*tasks)
                return health, late, running, results

        health, late, running, results = asyncio.run(go())
        assert running > 0, "the streams must still be running when the late request arrives"
        assert health.status_code == 503
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        assert results == [("length", True)] * 8
        assert srv.proc.wait(60) == 0
        assert "draining" in srv.log()
    finally:
        srv.stop()


def test_shutdown_timeout_aborts_what_is_left(tiny_llama_dir, tmp_path):
    srv = start_server(["--model", tiny_llama_dir, *BASE, "--shutdown-timeout", "0.5"], str(tmp_path / "server.log"))
    try:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        finish = []
        with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"]
                    if ch and ch[0]["finish_reason"]:
                        finish.append(ch[0]["finish_reason"])
                    elif not finish and srv.proc.poll() is None and not getattr(srv, "_sent", False):
                        srv.proc.send_signal(signal.SIGTERM)
                        srv._sent = True
        assert finish == ["abort"]
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()
