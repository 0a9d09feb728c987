"""`g4rt serve`: the HTTP service over one LLM, on loopback with a tiny random model."""
from __future__ import annotations

import http.client
import json
import threading

import pytest
import torch
from conftest import tiny_config

from g4rt.models.checkpoint import random_model
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig
from g4rt.runtime.server import Service, make_server

CONFIG = SchedulerConfig(max_num_batched_tokens=32, chunk=8)
FRAMES = 64
PROMPTS = [[2, 15, 7, 42, 9, 3, 11, 5, 8, 13, 21, 30], [2, 99, 4], [2, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config("31b"), torch.float32, "cpu", seed=7)


@pytest.fixture()
def served(model):
    llm = LLM.paged(model, num_frames=FRAMES, page_tokens=4, config=CONFIG)
    service = Service(llm).start()
    server = make_server(service, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], llm
    server.shutdown()
    server.server_close()
    service.close()


def post(port: int, body: dict, stream: bool = False):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if stream and resp.status == 200:
        lines = [json.loads(line) for line in resp.read().decode().splitlines() if line]
        return resp.status, lines
    return resp.status, json.loads(resp.read())


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())


def test_concurrent_requests_match_offline_generation(served, model):
    port, llm = served
    offline = LLM.paged(model, num_frames=FRAMES, page_tokens=4, config=CONFIG).generate(
        PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    results = [None] * len(PROMPTS)

    def client(i):
        results[i] = post(port, {"token_ids": PROMPTS[i], "max_tokens": 6, "ignore_eos": True})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (status, body), want in zip(results, offline):
        assert status == 200 and body["finish_reason"] == "length" and body["error"] is None
        assert body["token_ids"] == want.token_ids  # greedy; same steps up to batch composition
    h = health(port)
    assert h["running"] == h["waiting"] == 0 and h["free_frames"] == h["frames"] == FRAMES
    assert llm.scheduler.seqs == {}  # nothing kept once handed out


def test_streaming_sends_each_token_then_the_summary(served):
    port, _ = served
    status, lines = post(port, {"token_ids": PROMPTS[0], "max_tokens": 5, "ignore_eos": True, "stream": True},
                         stream=True)
    assert status == 200
    *tokens, summary = lines
    assert [t["token_id"] for t in tokens] == summary["token_ids"] and len(tokens) == 5


def test_bad_requests_name_the_field(served):
    port, _ = served
    for body, needle in [({"token_ids": [2], "max_tokens": "5"}, "'max_tokens'"),
                         ({"token_ids": [2], "temperatur": 1.0}, "temperatur"),
                         ({"max_tokens": 3}, "'prompt' and 'token_ids'"),
                         ({"prompt": "hi"}, "tokenizer"),
                         ({"token_ids": [2, 10 ** 6]}, "outside the vocabulary"),
                         ({"token_ids": [2], "top_p": 0}, "top_p"),
                         ({"token_ids": list(range(2, 400)), "max_tokens": 4000}, "max_model_len 4096"),
                         ({"token_ids": list(range(2, 400)), "max_tokens": 3000}, "frames")]:
        status, reply = post(port, body)
        assert status == 400 and needle in reply["error"], (body, reply)
    assert health(port)["free_frames"] == FRAMES


def test_a_client_that_hangs_up_frees_its_pages(served):
    port, llm = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"token_ids": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = json.loads(resp.readline())
    assert "token_id" in first
    assert health(port)["running"] == 1
    conn.sock.shutdown(2)
    conn.close()
    for _ in range(200):  # the server notices at its next write, then cancels
        h = health(port)
        if h["running"] == 0 and h["free_frames"] == FRAMES:
            break
        threading.Event().wait(0.05)
    assert h["running"] == 0 and h["free_frames"] == FRAMES
