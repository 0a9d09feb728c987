"""`g4rt serve` as a process on loopback: a burst of 512 streaming clients, a 50 MB body beside a
running stream, SIGTERM draining (the engine process gone after it). The client is bench/serve.py's
(raw asyncio HTTP/1.1)."""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

from g4rt.bench.serve import Connections, add_arguments, first_requests, request, sweep

BODY = {"prompt": "Hello héllo", "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "g4rt.cli", "serve", "--model", "tiny", "--port", "0",
                                 "--max-queue", "128", "--max-num-seqs", "256", "--shutdown-timeout", "3",
                                 "--served-model-name", "tiny"], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert "http://" in line, (line, log.read_text())
        url = line.split("http://")[1].split()[0].rstrip(";,")
        url = "http://" + url
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def ready(url) -> dict:
    return httpx.get(url + "/ready").json()


def run(coro):
    return asyncio.run(coro)


def test_a_burst_of_512_streams_completes_or_is_refused_by_policy(server):
    _, url, _ = server

    async def burst():
        return await asyncio.gather(*[request(url, "/v1/completions", {**BODY, "max_tokens": 8}) for _ in range(512)])
    results = run(burst())
    completed = [r for r in results if r.ok]
    refused = [r for r in results if r.status == 429]
    assert len(completed) + len(refused) == 512, {r.error for r in results if not r.ok and r.status != 429}
    assert len(completed) >= 128 and all(r.done and r.output_tokens == 8 for r in completed)
    end = time.monotonic() + 10
    while (s := ready(url))["running"] or s["free_frames"] != s["frames"]:
        assert time.monotonic() < end, s
        time.sleep(0.05)


def test_a_50mb_body_is_refused_at_once_while_a_stream_keeps_its_pace(server):
    _, url, _ = server
    host, port = url.removeprefix("http://").split(":")
    reply = {}

    def big_body():
        time.sleep(0.5)  # the stream is under way
        s = socket.create_connection((host, int(port)), timeout=10)
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 52428800\r\n\r\n{\"prompt\": \"")
        sender = threading.Thread(target=_send_quietly, args=(s, b"a" * (50 << 20)), daemon=True)
        sender.start()
        reply["head"] = s.recv(4096)
        reply["s"] = time.monotonic() - t0
        s.close()

    t = threading.Thread(target=big_body)
    t.start()
    r = run(request(url, "/v1/completions", {**BODY, "max_tokens": 200}))
    t.join(30)
    assert reply["head"].startswith(b"HTTP/1.1 413") and reply["s"] < 2.0, reply
    gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
    assert r.ok and r.output_tokens == 200 and max(gaps) < 0.5, max(gaps)


def test_bench_serve_splits_ttft_with_the_servers_metrics(server):
    """bench serve: the service's own TTFT and queue time (from /metrics deltas) lie within the client's
    TTFT, for each sequential request of --first-requests (a delta that took in another request's would
    not) and on average over a sweep point, which also records the API process's CPU seconds."""
    _, url, _ = server
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--url", url, "--first-requests", "3", "--input-len", "8", "--output-len", "2",
                         "--vocab", "200", "--concurrency", ""])

    def health_gets():
        metrics = httpx.get(url + "/metrics").text
        found = re.search(r'g4rt_http_requests_total\{endpoint="/health",status="200"\} ([\d.]+)', metrics)
        return float(found.group(1)) if found else 0.0
    health = health_gets()
    rec = first_requests(args)
    assert health_gets() == health + 1  # the client's own first connection went to /health
    assert rec["connections"] == 1  # ... and the series kept it
    for client, api, queue in zip(rec["ttft_ms"], rec["server_ttft_ms"], rec["queue_ms"]):
        assert 0 < queue < api < client, rec
    for side, key in (("client", "ttft_ms"), ("server", "server_ttft_ms")):
        assert rec["first_vs_rest_ms"][side] == pytest.approx(rec[key][0] - statistics.median(rec[key][1:]),
                                                              abs=1e-3)
    args = p.parse_args(["--url", url, "--num-prompts", "12", "--input-len", "8", "--output-len", "4",
                         "--vocab", "200", "--concurrency", "4"])
    rec, = sweep(args)
    assert rec["connections"] == 4  # one per concurrent request, kept alive over the point
    assert rec["completed"] == 12 and 0 < rec["queue_ms_mean"] < rec["server_ttft_ms_mean"] < rec["ttft_ms"]["mean"], rec
    assert 0 <= rec["api_cpu_s"] < rec["duration_s"] * os.cpu_count(), rec


def test_bench_client_retries_once_on_a_kept_connection_the_server_closed():
    """A kept-alive connection the server closed while idle (its keep-alive timeout) costs the next
    request a new connection, not an error; a fresh connection that fails is an error."""
    seen = []

    async def main():
        async def handle(reader, writer):
            seen.append(writer)
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()  # as a server whose keep-alive timeout passed
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = "http://127.0.0.1:%d" % srv.sockets[0].getsockname()[1]
        conns = Connections(url)
        first = await request(url, "/health", None, conns=conns)
        await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        second = await request(url, "/health", None, conns=conns)
        srv.close()
        await srv.wait_closed()
        gone = await request(url, "/health", None)
        conns.close()
        return first, second, gone, conns.opened
    first, second, gone, opened = asyncio.run(main())
    assert first.ok and second.ok and opened == 2 and len(seen) == 2, (first, second)
    assert not gone.ok and "ConnectionRefusedError" in gone.error


def _send_quietly(sock, data) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server answered 413 and closed without reading the body: that is the point


def test_sigterm_drains_streams_and_exits_0(server):
    proc, url, log = server

    async def streams():
        tasks = [asyncio.ensure_future(request(url, "/v1/completions", {**BODY, "max_tokens": n}))
                 for n in (6, 3000, 3000)]
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
        return results, time.monotonic() - t0
    results, drained_s = run(streams())
    assert [r.finish_reason for r in results] == ["length", "abort", "abort"]
    assert all(r.ok and r.done for r in results) and drained_s < 3 + 2
    assert proc.wait(15) == 0
    text = log.read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in text  # the access log
    assert re.search(r"warm-up done in [\d.]+ s: the engine's graphs [\d.]+ s, the sampler [\d.]+ s, "
                     r"requests [\d.]+ s", text)
    assert "draining" in text
    engine_pid = int(re.search(r"engine process (\d+)", text).group(1))
    assert engine_pid != proc.pid and not os.path.exists(f"/proc/{engine_pid}")  # it exited and was reaped


def test_compile_watch_names_what_compiled_after_it_started_and_puts_the_hook_back():
    """The engine loop's watch counts Dynamo graphs and Triton kernel variants compiled after warm-up
    (the interpreter compiles no kernel, so the JIT's hook is called here as the JIT calls it)."""
    import types

    import torch
    import triton

    from g4rt.runtime.service.engine_loop import CompileWatch

    seen = []
    before = triton.knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))  # compiled before the watch
        watch = CompileWatch()
        try:
            assert watch.take() == []
            torch.compile(lambda x: x - 3, backend="eager")(torch.ones(3))
            triton.knobs.runtime.jit_post_compile_hook(key=(), repr="", fn=types.SimpleNamespace(name="_k"),
                                                       compile={}, is_manual_warmup=False, already_compiled=False)
            assert watch.take() == ["triton _k", "dynamo graph"]
            assert watch.take() == [] and watch.total == 2
            assert seen == ["_k"]  # the hook that was there still runs
        finally:
            watch.close()
        assert triton.knobs.runtime.jit_post_compile_hook is before
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None

