"""The API process's cost per engine step, apart from the model's speed (CPU; no GPU needed).

`g4rt serve`'s API process must handle, per engine step, one update per running stream (detokenize,
stop strings, JSON and SSE framing, the event loop's writes) plus new requests. If that needs more
CPU than a step lasts, streams and new arrivals lag whatever the engine does. This drives the real
service (`Service` + `Server`: the API process is this one, its engine process spawned as always)
with `InstantEngine`, an engine that returns logits at once after sleeping `--step-ms` (what a GPU
step would take; the sleep costs no CPU), and runs `g4rt bench serve` (bench/serve.py) as the client
in a subprocess for each point. Per point it records:

* steps/s and tokens/s as the service delivered them (its /metrics counters);
* CPU seconds of this process per step message, in all and per thread (the event loop, which also
  reads, formats and writes the pipe's messages; the prepare pool), from /proc; the engine process's and
  the client's CPU beside them (all share the machine's cores);
* each request's first token split into five legs, joined by prompt (bench.serve.prompt_key) on the
  system-wide monotonic clock: client start -> its `Job` exists in the API process (connect, HTTP,
  parsing, preparing) -> the engine's arrival (the pipe, the engine loop reading commands between
  steps) -> the engine's first token (the engine's own TTFT) -> its chunk is formatted (the rest of that
  step, the pipe back, the event loop's turn to read it; the leg is still named `engine_to_reader_ms`)
  -> the client has it (the event loop's writes, the socket, the client's own loop).

    python -m g4rt.bench.api_cost --step-ms 0,10 --concurrency 64,256 --out cpu_api_step_cost.jsonl

`--apply-only` times the formatting alone, in this process without a server: `Outputs.apply`
on steps of one new token for each of `--concurrency` streaming completions (no event loop, no pipe).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import torch

from g4rt.bench.serve import percentiles, prompt_key

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class InstantEngine:
    """The Engine protocol (runtime/engines/__init__.py) at no compute: after sleeping `step_s`, each
    step's logits are rows of a fixed random table (so greedy tokens vary; never the first four ids,
    the tiny tokenizer's special tokens, which show as no text), and each request's engine-side times
    are recorded when it is released."""

    def __init__(self, geometry, config, step_s: float, seed: int = 0):
        self.geometry, self.config, self.step_s = geometry, config, step_s
        self.table = torch.randn(4096, config.vocab_size, generator=torch.Generator().manual_seed(seed))
        self.table[:, :4] = float("-inf")
        self.steps = 0
        self.llm = None  # the LLM around it (set by `instant_llm`): release reads the request's times there
        self.records: list[tuple] = []

    def step(self, batch, seq_ids=()):
        if self.step_s:
            time.sleep(self.step_s)
        rows = batch.logits_rows.numel()
        start = self.steps * 61 % (len(self.table) - rows)
        self.steps += 1
        return self.table[start:start + rows]

    def release(self, seq_id) -> None:
        seq = self.llm.scheduler.seqs.get(seq_id)
        if seq is not None:
            self.records.append((prompt_key(seq.prompt), seq.arrival, seq.first_token_time, seq.finish_time,
                                 len(seq.tokens) - len(seq.prompt)))


def instant_llm(step_s: float, max_num_seqs: int, max_model_len: int):
    """The engine process's LLM: the tiny model's geometry (vocab 512) over an InstantEngine. One torch
    thread: the CPU sampler's ops are tiny, and a second thread spinning between them takes a core
    from the API process (a GPU engine's host does not run them)."""
    from g4rt.models.config import load_config
    from g4rt.models.layout import KVLayout, PageGeometry
    from g4rt.models.tiny import TINY_CONFIG
    from g4rt.runtime.llm import LLM
    from g4rt.runtime.scheduler import SchedulerConfig

    torch.set_num_threads(1)
    cfg = load_config(TINY_CONFIG)
    engine = InstantEngine(PageGeometry.build(KVLayout.from_config(cfg), 16), cfg, step_s)
    sched = SchedulerConfig(max_num_batched_tokens=2048, chunk=512, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len)
    llm = LLM(engine, 16384, sched, eos_ids=cfg.eos_token_ids)
    engine.llm = llm
    return llm


class ApiTimes:
    """The API process's two timestamps per request (module docstring), taken by wrapping
    `EngineClient.submit` and `Outputs._stream_items` in this process (bench only: the library has no hooks)."""

    def __init__(self):
        from g4rt.runtime.service.client import EngineClient
        from g4rt.runtime.service.outputs import Outputs
        self.jobs: list[tuple[str, float]] = []
        self.first_chunk: list[tuple[str, float]] = []
        submit, stream_items = EngineClient.submit, Outputs._stream_items

        def timed_submit(client, job):
            self.jobs.append((prompt_key(job.spec.prompts[0]), job.arrival))
            return submit(client, job)

        def timed_stream_items(outputs, c, *args):
            if not c.last_sent:
                self.first_chunk.append((prompt_key(c.job.spec.prompts[c.prompt_index]), time.perf_counter()))
            return stream_items(outputs, c, *args)
        EngineClient.submit, Outputs._stream_items = timed_submit, timed_stream_items


def dump_records(path: str, llm) -> None:
    """After the service stopped, in the engine process: its per-request times, for the join."""
    with open(path, "w") as f:
        json.dump(llm.engine.records, f)


# ---- CPU accounting -----------------------------------------------------------------------------

def _ticks(stat_path: str) -> float:
    """utime + stime of a /proc stat file, in seconds (fields 14 and 15; the name may hold spaces)."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def _thread_group(name: str) -> str:
    if name.startswith("g4rt-prepare"):
        return "prepare"
    return "event_loop" if name == "g4rt-http" else "other"


def cpu_snapshot(engine_pid: int) -> dict:
    """CPU seconds so far: this process by thread group, the engine process, finished children (clients)."""
    groups: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            s = _ticks(f"/proc/self/task/{t.native_id}/stat")
        except (OSError, TypeError):
            continue  # the thread ended
        g = _thread_group(t.name)
        groups[g] = groups.get(g, 0.0) + s
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"api": _ticks("/proc/self/stat"), "threads": groups, "engine": _ticks(f"/proc/{engine_pid}/stat"),
            "children": ru.ru_utime + ru.ru_stime}


def _counter(metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


# ---- one arm: a service with one step time, every concurrency point -------------------------------

LEGS = ("client_to_job_ms", "job_to_engine_ms", "engine_ttft_ms", "engine_to_reader_ms", "reader_to_client_ms")


def legs(client: list[dict], api: ApiTimes, engine: list, window: tuple[float, float]) -> dict:
    """The first token's five legs in ms (module docstring), over the requests of the point that ran in
    `window` (points share prompts: the same seed) found everywhere."""
    def within(pairs):
        return {k: t for k, t in pairs if window[0] <= t <= window[1]}
    jobs, chunks = within(api.jobs), within(api.first_chunk)
    eng = {r[0]: r for r in engine if window[0] <= r[1] <= window[1]}
    rows = []
    for r in client:
        k, e = r["key"], eng.get(r["key"])
        if e is None or r["first"] is None or e[2] is None or k not in jobs or k not in chunks:
            continue
        t = (r["start"], jobs[k], e[1], e[2], chunks[k], r["first"])
        rows.append([b - a for a, b in zip(t, t[1:])])
    ms = lambda xs: {k: None if v is None else round(v * 1e3, 3) for k, v in percentiles(xs).items()}  # noqa: E731
    return {"joined": len(rows), **{name: ms([r[i] for r in rows]) for i, name in enumerate(LEGS)}}


def arm(a, step_ms: float, tmp: str, times: ApiTimes) -> list[dict]:
    import httpx

    from g4rt.runtime.server import Server
    from g4rt.runtime.service.app import Service, ServiceConfig
    from g4rt.runtime.service.wire import EngineSpec
    from g4rt.runtime.service.text import Tokenizer

    eng_path = os.path.join(tmp, f"engine_{step_ms}.json")
    spec = EngineSpec(functools.partial(instant_llm, step_ms / 1e3, a.max_num_seqs, a.max_model_len),
                      after=functools.partial(dump_records, eng_path))
    tok = None
    if a.tokenizer:
        from g4rt.models.tiny import ensure_tiny
        tok = Tokenizer.from_dir(ensure_tiny())
    service = Service(spec, ServiceConfig(served_model_name="instant", max_queue=4096), tokenizer=tok)
    server = Server(service, "127.0.0.1", 0, access_log=False, shutdown_timeout_s=2)
    if a.profile_loop:
        server.run = functools.partial(_profiled, server.run, f"{a.profile_loop}.{step_ms:g}")
    server.start()
    assert service.engine.ready.wait(120), "the engine never became ready"
    httpx.get(server.url + "/ready")  # the server's event loop answers: its start-up is in no point's CPU
    m, pid = service.metrics, service.engine.proc.pid
    points = []
    for conc in a.concurrency:
        req_path = os.path.join(tmp, f"requests_{step_ms}_{conc}.jsonl")
        pt_path = os.path.join(tmp, f"point_{step_ms}_{conc}.jsonl")
        cmd = [sys.executable, "-m", "g4rt.bench.serve", "--url", server.url, "--concurrency", str(conc),
               "--waves", str(a.waves), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
               "--len-spread", str(a.len_spread), "--vocab", "512", "--seed", str(a.seed),
               "--out", pt_path, "--requests-out", req_path]
        steps0, toks0 = _counter(m, "g4rt_step_seconds_count"), _counter(m, "g4rt_generation_tokens_total")
        c0, t0 = cpu_snapshot(pid), time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        c1, wall = cpu_snapshot(pid), time.perf_counter() - t0
        steps = _counter(m, "g4rt_step_seconds_count") - steps0
        toks = _counter(m, "g4rt_generation_tokens_total") - toks0
        with open(pt_path) as f:
            client = json.loads(f.readline())
        dur = client["duration_s"]
        threads = {g: c1["threads"].get(g, 0.0) - c0["threads"].get(g, 0.0) for g in c1["threads"]}
        api = c1["api"] - c0["api"]
        points.append({
            "bench": "api_cost", "label": a.label, "step_ms": step_ms, "concurrency": conc, "tokenizer": bool(tok),
            "loop": a.loop, "requests": client["completed"] + client["failed"], "failed": client["failed"],
            # CPU is counted over the client's whole run (its start-up too: the service idles then),
            # rates over the point's own duration
            "wall_s": round(wall, 3), "duration_s": round(dur, 3), "steps": int(steps),
            "steps_per_s": round(steps / dur, 1), "tokens": int(toks), "tokens_per_s": round(toks / dur, 1),
            "api_cpu_s": round(api, 3), "api_cpu_ms_per_step": round(1e3 * api / max(steps, 1), 3),
            "api_cpu_util": round(api / dur, 3),
            "api_thread_cpu_ms_per_step": {g: round(1e3 * v / max(steps, 1), 3) for g, v in sorted(threads.items())},
            "engine_cpu_s": round(c1["engine"] - c0["engine"], 3),
            "engine_cpu_ms_per_step": round(1e3 * (c1["engine"] - c0["engine"]) / max(steps, 1), 3),
            "client_cpu_s": round(c1["children"] - c0["children"], 3),
            "client": {k: client[k] for k in ("duration_s", "output_token_throughput", "ttft_ms", "tpot_ms",
                                              "itl_ms", "client_cpu_s")},
            "_requests": req_path, "_window": (t0, t0 + wall)})
    server.stop()
    with open(eng_path) as f:
        engine = json.load(f)
    for p in points:
        with open(p.pop("_requests")) as f:
            p.update(legs([r for r in map(json.loads, f) if r["point"] == 0 and r["ok"]], times, engine,
                          p.pop("_window")))
    return points


def apply_only(a, streams: int, steps: int = 40) -> dict:
    """Seconds per update of `Outputs.apply` (module docstring), best of three runs of `steps` steps."""
    import asyncio
    import random

    from g4rt.runtime.service import outputs, prepare
    from g4rt.runtime.service.metrics import Metrics
    from g4rt.runtime.service.text import Tokenizer
    from g4rt.runtime.service.wire import Update
    from g4rt.models.tiny import ensure_tiny

    tok = Tokenizer.from_dir(ensure_tiny()) if a.tokenizer else None
    ctx = prepare.Context("instant", 4096, tok, None)
    rng = random.Random(a.seed)
    body = json.dumps({"prompt": [rng.randrange(4, 512) for _ in range(a.input_len)], "max_tokens": steps,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "return_token_ids": True}).encode()
    loop = asyncio.new_event_loop()
    outputs._deliver = lambda posts: None  # nothing to deliver to: no loop runs
    best = float("inf")
    for _ in range(3):
        jobs = [outputs.Job(prepare.completion(body, ctx), "instant", loop, tok) for _ in range(streams)]
        out = outputs.Outputs(tok, Metrics(), lambda cids: None)
        ups = [[(j.choices[0], Update(i, [rng.randrange(4, 512)], None, "length" if s == steps - 1 else None))
                for i, j in enumerate(jobs)] for s in range(steps)]
        t0 = time.perf_counter()
        for step in ups:
            out.apply(step)
        best = min(best, (time.perf_counter() - t0) / (steps * streams))
    loop.close()
    return {"bench": "api_cost_apply", "label": a.label, "tokenizer": a.tokenizer, "streams": streams,
            "steps": steps, "us_per_update": round(best * 1e6, 2), "ms_per_step": round(best * streams * 1e3, 3)}


def _profiled(run, path: str):
    """`run` (the server's thread: its event loop) under cProfile, the stats written to `path`."""
    import cProfile
    prof = cProfile.Profile()
    try:
        return prof.runcall(run)
    finally:
        prof.dump_stats(path)


def main(argv=None) -> int:
    def nums(s):
        return [float(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(prog="python -m g4rt.bench.api_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=nums, default=[0.0, 10.0], help="the engine's step times to emulate")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    p.add_argument("--waves", type=int, default=4, help="requests per point: waves x concurrency")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--len-spread", type=float, default=0.25)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", action="store_true",
                   help="serve with the tiny model's tokenizer (text is detokenized, as `g4rt serve --model` does); "
                        "without it no text is made, as in `python -m g4rt.bench.serve host`")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="asyncio: the server runs without uvloop even where it is installed (an image without it)")
    p.add_argument("--profile-loop", default=None,
                   help="write cProfile stats of the event loop's thread to PATH.<step ms> (it slows the loop)")
    p.add_argument("--apply-only", action="store_true", help="time Outputs.apply alone (module docstring)")
    p.add_argument("--label", default=None, help="stored in each record (e.g. which code ran)")
    p.add_argument("--out", default=None, help="append one JSON line per point to this file")
    a = p.parse_args(argv)
    if a.apply_only:
        for streams in a.concurrency:
            _emit(a, apply_only(a, streams))
        return 0
    if a.loop == "asyncio":
        sys.modules["uvloop"] = None  # runtime/server.py falls back to asyncio when uvloop does not import
    times = ApiTimes()
    with tempfile.TemporaryDirectory(prefix="g4rt-api-cost-") as tmp:
        for step_ms in a.step_ms:
            for rec in arm(a, step_ms, tmp, times):
                _emit(a, rec)
    return 0


def _emit(a, rec: dict) -> None:
    print(json.dumps(rec), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
