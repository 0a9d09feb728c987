"""`g4rt serve` on loopback (the server in this process, its engine in a spawned one), driven by the
official `openai` client: the OpenAI API as `vllm serve` exposes it, on the tiny model (its tokenizer
and Gemma-style chat template); the engine process's failure and shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from g4rt.bench.serve import request
from g4rt.models.checkpoint import load_model
from g4rt.models.tiny import ensure_tiny
from g4rt.runtime.engines import EngineDead
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig
from g4rt.runtime.server import Server
from g4rt.runtime.service.app import Service, ServiceConfig, build_app
from g4rt.runtime.service.engine_loop import graph_bounds
from g4rt.runtime.service.wire import EngineSpec

CONFIG = SchedulerConfig(max_num_batched_tokens=128, chunk=64, max_num_seqs=16)
FRAMES = 64
NAME = "tiny"
KEY = "sk-test"


class Switches:
    """Test switches shared with the engine process: fail the next step, make it the engine's death
    (EngineDead), let steps run, let warm-up end."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.fail_next, self.running, self.warm = ctx.Event(), ctx.Event(), ctx.Event()
        self.die_next = ctx.Event()
        self.running.set()
        self.warm.set()


class TestEngine:
    """The eager engine, obeying `Switches` (it runs in the engine process)."""

    __test__ = False

    def __init__(self, inner, switches: Switches):
        self.inner, self.geometry, self.config, self.sw = inner, inner.geometry, inner.config, switches

    def warmup(self, **bounds) -> None:
        assert self.sw.warm.wait(30)

    def step(self, batch, seq_ids=(), **kw):
        assert self.sw.running.wait(30)
        if self.sw.fail_next.is_set():
            self.sw.fail_next.clear()
            raise RuntimeError("injected engine failure")
        if self.sw.die_next.is_set():
            raise EngineDead("injected engine death")
        return self.inner.step(batch, seq_ids, **kw)

    def release(self, seq_id) -> None:
        self.inner.release(seq_id)


def tiny_llm(d) -> LLM:
    return LLM.paged(load_model(d, dtype=torch.float32, device="cpu"), num_frames=FRAMES, page_tokens=16,
                     config=CONFIG)


def switched_llm(d, switches: Switches) -> LLM:
    """The engine process's builder (module-level: it is pickled to get there)."""
    llm = tiny_llm(d)
    llm.engine = TestEngine(llm.engine, switches)
    return llm


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny()


@contextlib.contextmanager
def serving(tiny, wait_ready=True, hold_warmup=False, **cfg):
    sw = Switches()
    if hold_warmup:
        sw.warm.clear()
    service = Service.from_dir(EngineSpec(functools.partial(switched_llm, tiny, sw)), tiny,
                               ServiceConfig(**{"served_model_name": NAME, "read_timeout_s": 1.0, **cfg}))
    server = Server(service, "127.0.0.1", 0, access_log=False, shutdown_timeout_s=2).start()
    try:
        if wait_ready:
            wait_for(lambda: httpx.get(server.url + "/ready").status_code == 200, timeout=60.0)
        yield server, sw
    finally:
        sw.warm.set()
        sw.running.set()
        server.stop()


def wait_for(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(httpx.TransportError):
            if cond():
                return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.fixture(scope="module")
def served(tiny):
    with serving(tiny, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def ready(server) -> dict:
    return httpx.get(server.url + "/ready").json()


def idle(server) -> bool:
    r = ready(server)
    return r["running"] == r["waiting"] == r["requests"] == 0 and r["free_frames"] == r["frames"]


def test_completion_matches_offline_generation(served, client, tiny):
    prompt = [2, 15, 7, 42, 9, 3, 11]
    want = tiny_llm(tiny).generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ch = r.choices[0]
    assert ch.token_ids == want.token_ids and ch.finish_reason == "length"
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 13
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    text = httpx.post(served[0].url + "/detokenize", json={"tokens": want.token_ids}).json()["prompt"]
    assert ch.text == text


def test_streamed_multibyte_text_equals_the_whole_text(client):
    kw = dict(model=NAME, prompt="héllo 日本語 🎉 wörld", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert all("\ufffd" not in c.choices[0].text for c in chunks[:-2] if c.choices) or "\ufffd" in whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_sse_frames_end_with_done(served):
    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", served[0].url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["object"] for e in events[:-1]] == ["text_completion"] * (len(events) - 1)


def test_n_choices_and_seeds(client):
    kw = dict(model=NAME, prompt=["Hello", "The cache"], max_tokens=8, temperature=1.0, n=3, seed=11,
              extra_body={"return_token_ids": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == list(range(6))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices[:3]}) > 1  # choice i samples with seed + i
    assert a.usage.completion_tokens == sum(len(c.token_ids) for c in a.choices)
    assert all(1 <= len(c.token_ids) <= 8 for c in a.choices)


def test_stop_strings_end_the_text_before_them(client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    stop = whole[9:12]  # three characters that can span tokens
    want = whole[:whole.find(stop)]
    r = client.completions.create(stop=[stop, "\x00never"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 3 and max(top.values()) == pytest.approx(chosen)  # greedy = argmax
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_chat_uses_the_checkpoint_template(served, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    tok = httpx.post(served[0].url + "/tokenize", json={"messages": messages}).json()
    rendered = "<bos><start_of_turn>user\nBe brief.\n\nHello there<end_of_turn>\n<start_of_turn>model\n"
    raw = httpx.post(served[0].url + "/tokenize", json={"prompt": rendered, "add_special_tokens": False}).json()
    assert tok["tokens"] == raw["tokens"] and tok["tokens"][0] == 2  # one BOS, from the template
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == tok["count"]
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="alternate"):
        client.chat.completions.create(model=NAME, messages=[{"role": "assistant", "content": "x"}], max_tokens=2)


def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(served[0].url + "/health").json() == {"status": "ok"}
    client.completions.create(model=NAME, prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    samples = dict(line.rsplit(" ", 1) for line in httpx.get(served[0].url + "/metrics").text.splitlines()
                   if line and not line.startswith("#"))
    for name in ("g4rt_time_to_first_token_seconds_count", "g4rt_inter_token_latency_seconds_count",
                 "g4rt_e2e_request_latency_seconds_count", "g4rt_request_queue_time_seconds_count",
                 "g4rt_step_seconds_count", "g4rt_prompt_tokens_total", "g4rt_generation_tokens_total",
                 'g4rt_request_finished_total{reason="length"}', "g4rt_ready",
                 'g4rt_http_requests_total{endpoint="/v1/completions",status="200"}'):
        assert float(samples.get(name, 0)) > 0, name  # observed, not only registered
    assert float(samples['g4rt_kv_frames{group="all",state="total"}']) == FRAMES
    assert float(samples["g4rt_compiles_after_ready_total"]) == 0  # exported; the eager CPU engine compiles nothing
    for name in ("g4rt_num_requests_running", "g4rt_num_requests_waiting", 'g4rt_kv_frames{group="full",state="used"}'):
        assert name in samples, name


@pytest.mark.parametrize("body, status, needle", [
    ({"model": "other", "prompt": "x"}, 404, "does not exist"),
    ({"prompt": "x", "temperatur": 1.0}, 400, "unknown field 'temperatur'"),
    ({"prompt": "x", "max_tokens": "five"}, 400, "max_tokens"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed"),
    ({"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed"),  # seed + 1 would overflow the step's int64 seeds
    ({"prompt": "x", "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": [2, 10**6]}, 400, "outside the vocabulary"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_model_len"),
    ({"prompt": "x" * 600_000}, 400, "longer than max_model_len"),
    ({"prompt": list(range(4, 400)), "max_tokens": 3600}, 422, "frames"),
    ({"prompt": "x", "presence_penalty": 0.5}, 400, "not supported"),
    ({"prompt": "x", "logit_bias": {"5": 1}}, 400, "logit_bias is not supported"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo with logprobs"),
])
def test_error_objects(served, client, body, status, needle):
    with pytest.raises(openai.APIStatusError) as e:
        client.post("/completions", body=body, cast_to=object)
    err = e.value.body
    assert e.value.status_code == status and needle in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    assert idle(served[0])


def test_auth_routes_and_methods(served):
    url = served[0].url
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/nope").status_code == 404 and "error" in httpx.get(url + "/nope").json()
    assert httpx.get(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}).status_code == 405
    assert httpx.get(url + "/metrics").status_code == 200  # only /v1/* needs the key
    r = httpx.options(url + "/v1/models", headers={"Origin": "http://evil", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers  # CORS is off unless --allowed-origins


def test_echo_and_an_empty_prompt(client):
    kw = dict(model=NAME, max_tokens=3, temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert client.completions.create(prompt=[2, 75, 131, 106], **kw).choices[0].text.startswith("hé")
    r = client.completions.create(prompt="", **kw)
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens == 3  # the empty text is its BOS


def test_an_unread_body_cannot_smuggle_a_request(served):
    inner = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    s = raw(served[0], b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: " + str(len(inner)).encode() +
            b"\r\n\r\n" + inner, timeout=1.0)
    data = b""
    with contextlib.suppress(socket.timeout):
        while chunk := s.recv(65536):
            data += chunk
    s.close()
    assert data.count(b"HTTP/1.1 ") == 1 and data.startswith(b"HTTP/1.1 404")


def test_cors_only_for_allowed_origins(tiny):
    with serving(tiny, allowed_origins=("http://ok.example",)) as (server, _):
        pre = {"Access-Control-Request-Method": "POST"}
        ok = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://ok.example", **pre})
        bad = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://evil.example", **pre})
        assert ok.headers.get("access-control-allow-origin") == "http://ok.example"
        assert "access-control-allow-origin" not in bad.headers
    proc = server.service.engine.proc
    assert server.exit_code == 0 and proc.exitcode == 0 and gone(proc.pid)  # stopped and reaped, not killed


def raw(server, head: bytes, timeout=10.0) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=timeout)
    s.sendall(head)
    return s


def test_body_limit_and_read_timeout(served):
    server = served[0]
    s = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 52428800\r\n\r\n{\"prompt\": \"")
    t0 = time.monotonic()
    reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413") and b"body_too_large" in reply and time.monotonic() - t0 < 2
    s.close()
    s = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    t0 = time.monotonic()
    reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408") and 0.9 < time.monotonic() - t0 < 5  # read_timeout_s = 1
    s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_frees_its_pages(served, stream):
    server, _ = served
    body = json.dumps({"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "stream": stream}).encode()
    s = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    wait_for(lambda: ready(server)["running"] == 1)
    if stream:
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    s.close()
    wait_for(lambda: idle(server), timeout=10)


def test_engine_failure_is_a_500_and_the_service_goes_on(served, client):
    server, sw = served
    sw.fail_next.set()
    with pytest.raises(openai.InternalServerError, match="injected engine failure"):
        client.completions.create(model=NAME, prompt="Hello", max_tokens=4)
    sw.fail_next.set()
    with pytest.raises(openai.APIError, match="injected engine failure"):  # an error event ends the stream
        list(client.completions.create(model=NAME, prompt="Hello", max_tokens=4, stream=True))
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    wait_for(lambda: idle(server))


def test_not_ready_until_warm_and_queue_limit(tiny):
    with serving(tiny, wait_ready=False, hold_warmup=True, max_queue=2) as (server, sw):
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200)
        assert httpx.get(server.url + "/ready").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "Retry-After" in r.headers
        sw.warm.set()
        wait_for(lambda: httpx.get(server.url + "/ready").status_code == 200)
        sw.running.clear()  # steps stall: the engine reports nothing, the requests count as waiting
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        done = []
        threads = [threading.Thread(target=lambda: done.append(
            c.completions.create(model=NAME, prompt="Hi", max_tokens=2))) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: server.service.engine.num_waiting() == 2)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=NAME, prompt="Hi", max_tokens=2)
        assert e.value.response.headers["Retry-After"] == "1"
        sw.running.set()
        for t in threads:
            t.join(30)
        assert len(done) == 2


def test_warm_up_bounds_cover_every_step(tiny):
    llm = tiny_llm(tiny)
    pt = llm.engine.geometry.page_tokens  # window 8: a decode step reads at most 2 sliding pages
    assert graph_bounds(llm) == {"max_seqs": 16, "max_sliding_pages": 2, "max_full_pages": 4096 // pt["full"],
                                 "max_tokens": 128}


def test_warm_up_sliding_bound_is_the_admission_rule(tiny):
    """The decode graphs' sliding width comes from the rule admission promises by (a chunk of one
    token), also where the page size divides W - 1 (there it is one page above the widest decode table,
    which a run confirms it covers)."""
    model = load_model(tiny, dtype=torch.float32, device="cpu")
    window = model.config.sliding_window
    for page_tokens in (4, 16, window - 1):  # two pages, under one page, W - 1 a page
        llm = LLM.paged(model, num_frames=FRAMES, page_tokens=page_tokens, config=CONFIG)
        geo = llm.engine.geometry
        bound = graph_bounds(llm)["max_sliding_pages"]
        assert bound == min(geo.pages_for("sliding", llm.scheduler.max_model_len), geo.sliding_pages_per_request(1))
    widths, step = [], llm.engine.step

    def record(batch, seq_ids=(), **kw):
        if batch.is_decode:
            widths.append(batch.sliding_table.shape[1])
        return step(batch, seq_ids, **kw)
    llm.engine.step = record
    llm.generate([list(range(3, 3 + n)) for n in (window + 1, 2 * window)],
                 SamplingParams(max_new_tokens=window, ignore_eos=True))
    assert max(widths) == 2 < bound == 3


def long_stream_running(server):
    """A long streaming completion on a thread, once the engine runs it: (the thread, the dict its result
    lands in as "r")."""
    stream = {}
    t = threading.Thread(target=lambda: stream.update(r=asyncio.run(request(
        server.url, "/v1/completions", {"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True,
                                        "stream": True}))))
    t.start()
    wait_for(lambda: ready(server)["running"] == 1)
    return t, stream


def test_an_engine_that_reports_itself_dead_stops_the_service(tiny):
    """EngineDead from a step (a tensor-parallel engine after a rank failed) is not one failed step: the
    engine process stops, requests in flight get a 500, /health turns 503 and the server exits 1."""
    with serving(tiny) as (server, sw):
        engine = server.service.engine
        t, stream = long_stream_running(server)
        sw.die_next.set()
        t.join(20)
        assert "the engine loop died: EngineDead: injected engine death" in stream["r"].error and stream["r"].done
        wait_for(lambda: server.exit_code is not None)
        assert server.exit_code == 1
        with TestClient(build_app(server.service)) as tc:
            health = tc.get("/health")
            assert health.status_code == 503 and "EngineDead" in health.json()["error"]
    assert gone(engine.proc.pid)


def test_a_dead_engine_process_fails_in_flight_requests_and_the_service(tiny):
    with serving(tiny) as (server, _):
        engine = server.service.engine
        t, stream = long_stream_running(server)
        os.kill(engine.proc.pid, signal.SIGKILL)
        t.join(20)
        assert "engine process died (exit code -9)" in stream["r"].error and stream["r"].done
        wait_for(lambda: server.exit_code is not None)  # the server shut itself down
        assert server.exit_code == 1
        with TestClient(build_app(server.service)) as tc:
            assert tc.get("/health").status_code == 503 and tc.get("/ready").status_code == 503
            assert tc.get("/ready").json()["engine_error"] == engine.failed
    assert gone(engine.proc.pid)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class _Broken:
    """Just what build_app reads of a Service, with a generate that fails as a bug would."""

    def __init__(self, origins):
        from g4rt.runtime.service.metrics import Metrics
        self.config, self.metrics = ServiceConfig(allowed_origins=origins), Metrics()

    async def generate(self, request, prepare_fn):
        raise RuntimeError("a bug")


@pytest.mark.parametrize("origins", [(), ("http://ok.example",)])  # served by _Gate itself, or by FastAPI's route
def test_an_unhandled_error_in_a_generation_endpoint_is_a_500_error_object(origins):
    service = _Broken(origins)
    with TestClient(build_app(service), raise_server_exceptions=False) as tc:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = tc.post(path, json={"prompt": [1]})
            assert r.status_code == 500 and r.json() == {"error": {
                "message": "internal error: RuntimeError", "type": "server_error", "param": None, "code": None}}


def test_ready_only_after_the_api_warm_up(tiny, monkeypatch):
    """/ready turns 200 only after the API process has sent its warm-up requests through its own app
    (each kind WARM_ROUNDS times: streamed and plain token ids, text, chat), all answered 200, with
    readiness still 503 while they run; generation is accepted meanwhile (the engine is warm)."""
    from g4rt.runtime.service import app as app_module

    services, calls = [], []  # the service under test (recorded as its warm-up starts), and each call
    real_post, real_warm_up = app_module.asgi_post, app_module.Service.warm_up

    async def warm_up(self, app):
        services.append(self)
        return await real_warm_up(self, app)

    async def post(app, path, body, headers):
        before = (path, services[0].ready, services[0].accepting)
        calls.append(before + (await real_post(app, path, body, headers),))
        return calls[-1][-1]
    monkeypatch.setattr(app_module, "asgi_post", post)
    monkeypatch.setattr(app_module.Service, "warm_up", warm_up)
    with serving(tiny, api_key=KEY) as (server, _):
        assert ready(server)["api_warmup_s"] > 0
        rounds = app_module.Service.WARM_ROUNDS
        assert [c[0] for c in calls] == (["/v1/completions"] * 3 + ["/v1/chat/completions"]) * rounds
        assert all(c[1:] == (False, True, 200) for c in calls), calls
        metrics = httpx.get(server.url + "/metrics").text
        assert f'g4rt_http_requests_total{{endpoint="/v1/chat/completions",status="200"}} {rounds}.0' in metrics

