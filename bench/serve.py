"""`g4rt bench serve`: a load generator for the OpenAI-compatible service (like vLLM's benchmark_serving).

Each sweep point sends `--num-prompts` streaming completions, either closed-loop at a fixed
concurrency or open-loop at a Poisson request rate (capped by `--max-concurrency`), with prompts of
random token ids (no tokenizer needed) whose lengths are drawn uniformly from input-len x [1 - r, 1 + r]
(and output lengths likewise, enforced with ignore_eos). It reports TTFT, inter-token latency (ITL,
every gap between token deliveries), time per output token (TPOT, (E2E - TTFT) / (tokens - 1)) and
end-to-end latency at p50 / p90 / p99, request and token throughput, and errors by kind, as one JSON
object per point.

`python -m g4rt.bench.serve host --config e2b ...` serves a random checkpoint of a published size on
the inductor engine (GPU) and, once SIGTERM has drained it, runs the same workload offline through the
same warmed-up `LLM` in the service's engine process: the two arms share every compiled kernel and
captured graph.

The client is raw asyncio HTTP/1.1 (connections kept alive, SSE parsed by hand once a response has
ended) so that its own cost stays far below the server's: a general-purpose client spends more per
chunk than a decode step of a small model lasts. `offline` runs the same prompts through `LLM`
in-process at the same concurrency, the ceiling the service is compared against.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Result:
    ok: bool = False
    status: int | None = None
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    output_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False  # the stream ended with data: [DONE]
    end: float = 0.0


async def _read_headers(reader) -> tuple[int, dict]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    return status, headers


async def _body_chunks(reader, headers):
    """The response body as it arrives (chunked transfer or Content-Length)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    else:
        yield await reader.readexactly(int(headers.get("content-length", 0)))


class Connections:
    """Idle keep-alive connections to one server, for one event loop: a request takes one (or opens
    one) and gives it back once it has read the whole response, as the `openai` client's connection
    pool does. A new connection per request would add a TCP handshake and the server's connection
    set-up to every request's way in, which a closed-loop client pays on its critical path."""

    def __init__(self, url: str):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.idle: list = []
        self.opened = 0

    async def get(self) -> tuple:
        """(reader, writer, reused)"""
        if self.idle:
            return (*self.idle.pop(), True)
        self.opened += 1
        return (*await asyncio.open_connection(self.host, self.port, limit=1 << 22), False)

    def close(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()


async def request(url: str, path: str, body: dict | None, api_key: str | None = None,
                  timeout: float = 600.0, conns: Connections | None = None) -> Result:
    """POST `body` to url+path (GET when it is None); with "stream": true, time every SSE chunk that
    carries tokens. With `conns` the connection is kept alive and given back, else it is closed.
    A chunk's arrival time is taken when its bytes come in, and chunks are parsed after the response
    ended, so the client's own work per chunk stays small while streams are running."""
    u = urlsplit(url)
    r = Result(start=time.perf_counter())
    data = b"" if body is None else json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    post = "" if body is None else f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    head = (f"{'GET' if body is None else 'POST'} {path} HTTP/1.1\r\nHost: {u.hostname}\r\n{post}{auth}"
            f"Connection: {'keep-alive' if conns else 'close'}\r\n\r\n").encode()
    pool = conns or Connections(url)  # a pool of its own opens one connection, closed at the end
    writer, keep, events = None, False, []
    try:
        async with asyncio.timeout(timeout):
            for attempt in (0, 1):
                reader, writer, reused = await pool.get()
                try:
                    writer.write(head + data)
                    await writer.drain()
                    r.status, headers = await _read_headers(reader)
                    break
                except (ConnectionError, asyncio.IncompleteReadError):
                    writer.close()
                    writer = None
                    if not reused or attempt:  # a kept connection the server had closed: one retry
                        raise
            keep = conns is not None and headers.get("connection", "").lower() != "close"
            buf = b""
            async for chunk in _body_chunks(reader, headers):
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    events.append((event, time.perf_counter()))
            for event, t in events:
                _event(r, event, t)
            if r.status != 200:
                r.error = f"HTTP {r.status}"
            elif body is not None and not body.get("stream"):
                _final(r, json.loads(buf))
            r.ok = r.error is None
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
        r.error, keep = f"{type(e).__name__}: {e}", False
    finally:
        r.end = time.perf_counter()
        if writer is not None:
            if keep:
                pool.idle.append((reader, writer))
            else:
                writer.close()
    return r


def _event(r: Result, event: bytes, t: float) -> None:
    if not event.startswith(b"data: "):
        return
    payload = event[6:]
    if payload == b"[DONE]":
        r.done = True
        return
    obj = json.loads(payload)
    if "error" in obj:
        r.error = obj["error"].get("message", "error")
        return
    if obj.get("usage"):
        _final(r, obj)
    for ch in obj.get("choices", []):
        r.finish_reason = ch.get("finish_reason") or r.finish_reason
        if ch.get("text") or ch.get("token_ids") or (ch.get("delta") or {}).get("content"):
            r.ttft = r.ttft if r.ttft is not None else t - r.start
            r.token_times.append(t)


def _final(r: Result, obj: dict) -> None:
    u = obj.get("usage") or {}
    r.output_tokens, r.prompt_tokens = u.get("completion_tokens", 0), u.get("prompt_tokens", 0)


# ---- workload -----------------------------------------------------------------------------------

def lengths(mean: int, spread: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return [rng.randint(lo, hi) for _ in range(n)]


def workload(n: int, input_len: int, output_len: int, spread: float, vocab: int, seed: int):
    """`n` (prompt token ids, output length) pairs; ids avoid the first 4 (special) ids of the vocab."""
    rng = random.Random(seed)
    ins, outs = lengths(input_len, spread, n, rng), lengths(output_len, spread, n, rng)
    return [([rng.randrange(4, vocab) for _ in range(i)], o) for i, o in zip(ins, outs)]


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]
    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"HTTP {r.status}" if r.status and r.status != 200 else (r.error or "?").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    tpot = [(r.end - r.start - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ms = lambda d: {k: None if v is None else v * 1e3 for k, v in d.items()}  # noqa: E731
    return {"completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration, "output_tokens": out_tokens,
            "ttft_ms": ms(percentiles([r.ttft for r in ok if r.ttft is not None])), "itl_ms": ms(percentiles(itl)),
            "tpot_ms": ms(percentiles(tpot)), "e2e_ms": ms(percentiles([r.end - r.start for r in ok]))}


def prompt_key(prompt: list[int]) -> str:
    """A request's name in per-request records: its prompt's first ids (random prompts rarely share them),
    so the engine's records of the same request (bench/api_cost.py) can be joined with the client's."""
    return ",".join(map(str, prompt[:8]))


async def run_point(url: str, model: str | None, items, *, concurrency: int | None, rate: float | None,
                    seed: int, api_key: str | None = None, path: str = "/v1/completions",
                    records: list | None = None, conns: Connections | None = None) -> dict:
    """One sweep point: closed loop at `concurrency`, or Poisson arrivals at `rate` (req/s) capped by it.
    The summary's `client_cpu_s` is this process's CPU time over the point (the load generator shares
    the host's cores with the server); `records`, when given, gets one dict per request (times in
    `time.perf_counter`, the system-wide monotonic clock on Linux). Connections are kept alive over the
    point (`conns`, or a pool of its own)."""
    sem = asyncio.Semaphore(concurrency or len(items))
    rng = random.Random(seed)
    pool = conns or Connections(url)

    async def one(prompt, out_len):
        async with sem:
            body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True}
            if model:
                body["model"] = model
            return await request(url, path, body, api_key, conns=pool)

    t0, cpu0 = time.perf_counter(), time.process_time()
    tasks = []
    for prompt, out_len in items:
        tasks.append(asyncio.ensure_future(one(prompt, out_len)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    res = summarize(results, time.perf_counter() - t0)
    res["client_cpu_s"] = time.process_time() - cpu0
    res["connections"] = pool.opened  # over the point (and before it, when `conns` is shared)
    if conns is None:
        pool.close()
    if records is not None:
        records += [{"key": prompt_key(p), "start": r.start, "first": None if r.ttft is None else r.start + r.ttft,
                     "end": r.end, "tokens": r.output_tokens, "ok": r.ok} for (p, _), r in zip(items, results)]
    return res


def _emit(args, rec: dict) -> dict:
    print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def _workload(args, concurrency: int | None = None):
    """The point's prompts: --waves x `concurrency` of them (closed loop, with --waves), else --num-prompts."""
    n = args.waves * concurrency if args.waves and concurrency else args.num_prompts
    return workload(n, args.input_len, args.output_len, args.len_spread, args.vocab, args.seed)


def _point(args, kind: str, conc, rate, rep: int, num_prompts: int, res: dict) -> dict:
    return {"bench": "serve", "mode": kind, "concurrency": conc, "request_rate": rate, "rep": rep,
            "num_prompts": num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "len_spread": args.len_spread, **res}


SERVER_SUMS = {"server_ttft": "g4rt_time_to_first_token_seconds_sum", "queue": "g4rt_request_queue_time_seconds_sum",
               "api_cpu": "process_cpu_seconds_total"}


def server_sums(url: str) -> dict[str, float] | None:
    """The sums of the service's TTFT and queue-time histograms and its API process's CPU seconds
    (/metrics), by the keys of SERVER_SUMS; None if it has not all of them."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = dict(line.partition(" ")[::2] for line in text.splitlines() if not line.startswith("#"))
    try:
        return {key: float(values[name]) for key, name in SERVER_SUMS.items()}
    except KeyError:
        return None


def server_delta(before: dict | None, after: dict | None, key: str, per: int = 1) -> float | None:
    """Milliseconds of `key`'s sum between two `server_sums`, per `per` requests."""
    if before is None or after is None or per == 0:
        return None
    return round((after[key] - before[key]) / per * 1e3, 3)


def first_requests(args) -> dict:
    """`--first-requests N` sequential requests right after readiness: is the first as fast as the Nth?
    All N have --input-len and --output-len exactly (no --len-spread): prompts of other lengths pad to
    other token buckets, whose steps cost more or less, which would hide or fake a first-request stall.
    With --idle-gap S the client waits S seconds before each: whether a request after the server sat idle
    pays more than one right after another, whatever came before it.
    The service's own view of each, from its /metrics after each request (they run one at a time):
    `server_ttft_ms` from its arrival in the API process to its first token there, `queue_ms` from its
    arrival in the engine to its first step. The client's TTFT less `server_ttft_ms` is the client and
    the connection; `server_ttft_ms` less `queue_ms` is the way to the engine and back and the prefill.
    `first_vs_rest_ms`: the first one's TTFT less the median of the others', the client's and the
    service's (positive: the first was slower)."""
    items = workload(args.first_requests, args.input_len, args.output_len, 0.0, args.vocab, args.seed)
    rs, server = [], {"server_ttft": [], "queue": []}

    async def series():
        # This process's first connection costs it more than the later ones (its first socket and HTTP
        # code paths): it is opened by a GET /health, which the service answers as it does readiness
        # probes, and kept alive for the series, as a client's pool would.
        conns = Connections(args.url)
        await request(args.url, "/health", None, args.api_key, conns=conns)
        before = server_sums(args.url)  # blocking: nothing else runs on this loop meanwhile
        for it in items:
            await asyncio.sleep(args.idle_gap)
            rs.append(await run_point(args.url, args.model, [it], concurrency=1, rate=None, seed=args.seed,
                                      api_key=args.api_key, conns=conns))
            after = server_sums(args.url)
            for key in server:
                server[key].append(server_delta(before, after, key))
            before = after
        conns.close()
        return conns.opened
    opened = asyncio.run(series())
    ttft = [r["ttft_ms"]["p50"] for r in rs]

    def first_vs_rest(xs):
        return round(xs[0] - statistics.median(xs[1:]), 3) if len(xs) > 1 and None not in xs else None
    return _emit(args, {"bench": "serve", "mode": "first_requests", "idle_gap_s": args.idle_gap,
                        "first_vs_rest_ms": {"client": first_vs_rest(ttft),
                                             "server": first_vs_rest(server["server_ttft"])},
                        "ttft_ms": ttft, "connections": opened,
                        "server_ttft_ms": server["server_ttft"], "queue_ms": server["queue"],
                        "e2e_ms": [r["e2e_ms"]["p50"] for r in rs], "tpot_ms": [r["tpot_ms"]["p50"] for r in rs]})


def sweep(args) -> list[dict]:
    if args.first_requests:
        first_requests(args)
    points = [("concurrency", c, None) for c in args.concurrency] + \
             [("rate", args.max_concurrency, r) for r in args.request_rate]
    out = []
    for rep in range(args.repeat):
        for kind, conc, rate in points:
            items = _workload(args, conc if kind == "concurrency" else None)
            if args.warmup_prompts:
                asyncio.run(run_point(args.url, args.model, items[:args.warmup_prompts], concurrency=conc or 1,
                                      rate=None, seed=args.seed, api_key=args.api_key))
            records = [] if args.requests_out else None
            before = server_sums(args.url)
            res = asyncio.run(run_point(args.url, args.model, items, concurrency=conc, rate=rate, seed=args.seed,
                                        api_key=args.api_key, records=records))
            after = server_sums(args.url)  # the service's view: mean TTFT and queue time, its API process's CPU
            cpu_ms = server_delta(before, after, "api_cpu")
            res.update(server_ttft_ms_mean=server_delta(before, after, "server_ttft", res["completed"]),
                       queue_ms_mean=server_delta(before, after, "queue", res["completed"]),
                       api_cpu_s=None if cpu_ms is None else cpu_ms / 1e3)
            out.append(_emit(args, _point(args, kind, conc, rate, rep, len(items), res)))
            if records:
                with open(args.requests_out, "a") as f:
                    f.writelines(json.dumps({"point": len(out) - 1, **r}) + "\n" for r in records)
    return out


def offline(llm, items, concurrency: int) -> dict:
    """The same workload through `LLM` in-process, at most `concurrency` requests in flight (closed loop):
    the ceiling the HTTP service is measured against."""
    import torch

    from g4rt.runtime.sampling import SamplingParams

    pending = list(items)
    arrival, first, last, counts, done = {}, {}, {}, {}, []
    t0 = time.perf_counter()
    with torch.inference_mode():
        while pending or llm.has_unfinished():
            while pending and len(arrival) - len(done) < concurrency:
                prompt, out_len = pending.pop(0)
                rid = llm.add_request(prompt, SamplingParams(max_new_tokens=out_len, ignore_eos=True))
                arrival[rid] = time.perf_counter()
            finished = llm.step()
            now = time.perf_counter()
            for seq in llm.scheduler.running:
                n = len(seq.output)
                if n and seq.seq_id not in first:
                    first[seq.seq_id] = now
                counts[seq.seq_id] = n
            for o in finished:
                first.setdefault(o.request_id, now)
                last[o.request_id], counts[o.request_id] = now, len(o.token_ids)
                done.append(o.request_id)
    duration = time.perf_counter() - t0
    results = [Result(ok=True, start=arrival[i], ttft=first[i] - arrival[i], output_tokens=counts[i],
                      prompt_tokens=len(items[k][0]), end=last[i]) for k, i in enumerate(sorted(arrival))]
    rec = summarize(results, duration)
    rec.pop("itl_ms")
    return rec


def add_arguments(p: argparse.ArgumentParser) -> None:
    def ints(s):
        return [int(x) for x in s.split(",") if x]

    def floats(s):
        return [float(x) for x in s.split(",") if x]
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default=None, help="the served model name to send (default: none, any is accepted)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per sweep point")
    p.add_argument("--waves", type=int, default=None,
                   help="instead of --num-prompts: waves x concurrency requests per concurrency point")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--len-spread", type=float, default=0.0,
                   help="lengths drawn uniformly from len x [1 - s, 1 + s] (0: fixed lengths)")
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [4, vocab)")
    p.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64], help="closed-loop points, e.g. 1,8,64")
    p.add_argument("--request-rate", type=floats, default=[], help="Poisson points in requests/s, e.g. 2,8")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight at a rate point")
    p.add_argument("--warmup-prompts", type=int, default=0, help="requests sent (and not counted) before each point")
    p.add_argument("--repeat", type=int, default=1, help="run the whole sweep this many times")
    p.add_argument("--first-requests", type=int, default=0,
                   help="first send this many sequential requests (TTFT of each: the first vs the last)")
    p.add_argument("--idle-gap", type=float, default=0.0,
                   help="seconds the client waits before each of the --first-requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="append one JSON line per point to this file")
    p.add_argument("--requests-out", default=None,
                   help="append one JSON line per request (its prompt's key, start, first token, end) to this file")


def _random_llm(a):
    """The host's LLM (built in the service's engine process): a random checkpoint on the inductor engine."""
    import torch

    from g4rt.models.checkpoint import random_model
    from g4rt.models.config import load_config
    from g4rt.models.layout import PageGeometry
    from g4rt.runtime.engines.inductor import InductorEngine
    from g4rt.runtime.llm import LLM
    from g4rt.runtime.scheduler import SchedulerConfig

    t0 = time.perf_counter()
    model = random_model(load_config(a.config), dtype=torch.bfloat16, device=a.device, seed=a.seed)
    geometry = PageGeometry.build(model.layout, 16)
    frames = int(a.kv_gib * 2**30) // geometry.frame_bytes()
    cfg = SchedulerConfig(max_num_batched_tokens=max(a.chunk, 2048), chunk=a.chunk, max_num_seqs=a.max_num_seqs,
                          max_model_len=a.max_model_len)
    llm = LLM(InductorEngine(model, geometry, frames), frames, cfg, eos_ids=model.config.eos_token_ids)
    print(f"g4rt bench host: built {a.config} in {time.perf_counter() - t0:.1f} s", flush=True)
    return llm


def _offline_arm(a, llm) -> None:
    """After the service stopped, in its engine process: the same workloads through the warmed-up `LLM`."""
    from g4rt.runtime.service.engine_loop import warm_up

    _emit(a, {"bench": "serve", "mode": "engine", "decode_graphs": len(getattr(llm.engine, "_graphs", {})),
              "rewarm_s": warm_up(llm)})  # nothing new to compile or capture: it starts where the service left off
    for rep in range(a.repeat):
        for conc in a.concurrency:
            items = _workload(a, conc)
            _emit(a, _point(a, "offline", conc, None, rep, len(items), offline(llm, items, conc)))


def host(argv) -> int:
    """Serve a random checkpoint on the inductor engine, then run the same workload offline (see above)."""
    import functools
    import logging

    from g4rt.runtime.server import Server
    from g4rt.runtime.service.app import Service, ServiceConfig
    from g4rt.runtime.service.wire import EngineSpec

    p = argparse.ArgumentParser(prog="python -m g4rt.bench.serve host")
    add_arguments(p)
    p.add_argument("--config", default="e2b", help="a published size or a config.json path")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--kv-gib", type=float, default=16.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    spec = EngineSpec(functools.partial(_random_llm, a), after=functools.partial(_offline_arm, a))
    service = Service(spec, ServiceConfig(served_model_name=a.config, max_queue=4096))
    build_s = time.perf_counter() - t0
    server = Server(service, "127.0.0.1", a.port, access_log=False, shutdown_timeout_s=5)
    print(f"g4rt bench host: {a.config} inductor on {server.url} ({service.engine.info['num_frames']} frames)",
          flush=True)
    code = server.run()  # after the drain it waits for the engine process's offline arm
    _emit(a, {"bench": "serve", "mode": "host", "config": a.config, "build_s": build_s, "exit_code": code,
              "warmup_s": service.engine.warmup_s, "frames": service.engine.info["num_frames"],
              "max_num_seqs": a.max_num_seqs, "max_model_len": a.max_model_len})
    return code


def main(argv=None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["host"]:
        return host(argv[1:])
    p = argparse.ArgumentParser(prog="g4rt bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    sweep(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
