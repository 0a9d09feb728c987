"""The engine process: the only code that touches the `LLM` (wire.py says why it is a process).

`engine_main` builds the LLM from an `EngineSpec`, warms it up (every decode graph the scheduler can
ask for, then a few real requests through the whole path) before it reports ready, then steps
whenever there is work. Between steps it reads the API process's commands off the pipe (without
waiting while there is work); after each step it sends every choice's new tokens in one message. A
step that raises fails the requests it held (the scheduler ends them with the error) and the loop
goes on with the rest, unless the engine raised `EngineDead` (engines/__init__.py: it can run no
further step): then the loop ends, the process reports "fatal" and exits, and the API process fails
every request in flight, turns /health and /ready to 503 and shuts the server down (client.py), so a
liveness probe sees the death and the service is restarted. The process ignores SIGINT and SIGTERM
(a terminal or a service manager sends them to the whole group): the API process drains and stops
it, and it exits on its own when that process goes away (the pipe's end of file).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch

from ..admission import RequestTooLarge
from ..engines import EngineDead
from ..llm import LLM
from ..sampling import SamplingParams, SamplingRows
from .wire import Add, EngineSpec

log = logging.getLogger("g4rt.serve")


def graph_bounds(llm: LLM) -> dict:
    """The largest decode batch, page-table widths and step token count this scheduler can produce
    (the engine's warm-up captures every graph within them). A decode step's sliding table is at most
    the sliding pages one request holds for a chunk of one token, the bound admission promises
    (models/layout.py `sliding_pages_per_request`)."""
    sched = llm.scheduler
    geo, max_len = sched.geometry, sched.max_model_len
    sliding = min(geo.pages_for("sliding", max_len), geo.sliding_pages_per_request(1))
    return {"max_seqs": sched.config.max_num_seqs, "max_sliding_pages": sliding,
            "max_full_pages": geo.pages_for("full", max_len), "max_tokens": sched.config.max_num_batched_tokens}


def warm_sampler(llm: LLM) -> None:
    """Launch the sampler at every row count a step can have (1 .. max_num_seqs), rows without and with
    top-k and top-p, so that none of its kernel variants compiles during serving: Triton compiles one per
    split count (a constexpr that falls with the row count), per row count that is 1, a multiple of 16 or
    neither, and with or without the top-k gathering pass and the split top-p rounds. Only where the sampler
    runs Triton (CUDA)."""
    device = getattr(llm.engine, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return
    rows = llm.scheduler.config.max_num_seqs
    logits = torch.randn(rows, llm.scheduler.geometry.layout.config.vocab_size, device=device)
    for r in range(1, rows + 1):
        for top_k, top_p in ((0, 1.0), (0, 0.9), (64, 1.0), (64, 0.9)):
            llm.sampler(logits[:r], SamplingRows([1.0] * r, [top_k] * r, [top_p] * r, [0] * r, [0] * r))


def warm_up(llm: LLM) -> float:
    """Everything a first request would otherwise pay for: the engine's own warm-up (every decode and
    piecewise graph within `graph_bounds`), the sampler's kernels (`warm_sampler`), then prompts through
    the whole step path, each alone (a single-sequence prefill) and all together (a multi-sequence
    prefill, mixed steps, decode), greedy and sampled. Their lengths cover sizes compilers commonly
    specialise on (1, a multiple of 16 and not, a full chunk). Returns the seconds it took.

    Each prompt also runs alone: a warm-up of only the prompts together leaves the first single-request
    prefill slow on CUDA (runtime/results/README.md, the `g4rt serve` section, has the times)."""
    t0 = time.perf_counter()
    if hasattr(llm.engine, "warmup"):
        llm.engine.warmup(**graph_bounds(llm))
    t1 = time.perf_counter()
    warm_sampler(llm)
    t2 = time.perf_counter()
    sched = llm.scheduler
    max_len, vocab = sched.max_model_len, sched.geometry.layout.config.vocab_size
    lens = sorted({max(1, min(n, max_len - 4)) for n in (sched.config.chunk + 1, 48, 17, 2)}, reverse=True)
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in lens]
    greedy = SamplingParams(max_new_tokens=3, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=5, seed=0, ignore_eos=True)
    for p in prompts:
        llm.generate([p], greedy)
    llm.generate(prompts, [(greedy, sampled)[i % 2] for i in range(len(prompts))])
    seconds = time.perf_counter() - t0
    log.info("warm-up done in %.1f s: the engine's graphs %.1f s, the sampler %.1f s, requests %.1f s",
             seconds, t1 - t0, t2 - t1, seconds - (t2 - t0))
    return seconds


class CompileWatch:
    """Counts kernel compilations after readiness, the stalls warm-up exists to prevent: every Triton
    kernel variant compiled in this process (`triton.knobs.runtime.jit_post_compile_hook`; one per new
    specialisation of a launch's constexprs, pointer alignments and integer arguments) and every graph
    Dynamo compiles (Inductor's own kernels are compiled with their graph). `take()` names those since
    the last call; the engine loop logs them with the step that paid for them, and /metrics counts them."""

    def __init__(self):
        self.total = 0
        self._new: list[str] = []
        self._graphs = self._dynamo_graphs()
        self._chained = self._runtime = None
        try:
            import triton
        except ImportError:  # no Triton: nothing of ours compiles kernels
            return
        self._runtime = triton.knobs.runtime
        self._chained, self._runtime.jit_post_compile_hook = self._runtime.jit_post_compile_hook, self._triton

    def close(self) -> None:
        """Put back the hook that was there before."""
        if self._runtime is not None and self._runtime.jit_post_compile_hook == self._triton:
            self._runtime.jit_post_compile_hook = self._chained

    @staticmethod
    def _dynamo_graphs() -> int:
        dynamo = sys.modules.get("torch._dynamo")  # never imported: nothing was compiled through it
        return dynamo.utils.counters["stats"]["unique_graphs"] if dynamo is not None else 0

    def _triton(self, *, fn, **kw):
        self._new.append(f"triton {fn.name}")
        return self._chained(fn=fn, **kw) if self._chained else None

    def take(self) -> list[str]:
        graphs = self._dynamo_graphs()
        new, self._new = self._new + ["dynamo graph"] * (graphs - self._graphs), []
        self._graphs = graphs
        self.total += len(new)
        return new


def engine_main(conn, spec: EngineSpec, log_level: int) -> None:
    """The engine process's entry point (multiprocessing, "spawn": CUDA cannot be used after a fork)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        llm = spec.build()
    except BaseException as e:  # SystemExit from the CLI's builders carries their message
        if not isinstance(e, SystemExit):
            log.exception("building the engine failed")
        conn.send(("failed", str(e) if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"))
        return
    s = llm.scheduler
    conn.send(("built", {"max_model_len": s.max_model_len, "num_frames": llm.pool.num_frames,
                         "max_num_seqs": s.config.max_num_seqs, "engine": type(llm.engine).__name__,
                         "pid": os.getpid()}))
    try:
        EngineLoop(llm, conn).serve()
    except BaseException as e:
        log.exception("the engine loop stopped; the service cannot go on")
        try:
            conn.send(("fatal", f"{type(e).__name__}: {e}"))
        except OSError:
            pass  # the API process is gone too
        raise SystemExit(1) from None
    if spec.after is not None:
        spec.after(llm)


class _Tracked:
    __slots__ = ("cid", "sent", "scheduled", "logprobs")

    def __init__(self, cid: int, logprobs: bool):
        self.cid, self.sent, self.scheduled, self.logprobs = cid, 0, False, logprobs


class EngineLoop:
    def __init__(self, llm: LLM, conn):
        self.llm, self.conn = llm, conn
        self._tracked: dict[int, _Tracked] = {}  # engine request id -> its choice
        self._rids: dict[int, int] = {}  # choice id -> engine request id
        self._finished: list = []  # outputs taken while refusing an admission, published with the next step
        self._deadline: float | None = None  # drain: abort what still runs at this time

    def serve(self) -> None:
        with torch.inference_mode():
            warmup_s = warm_up(self.llm)
            self._compiles = CompileWatch()
            try:
                self._publish([], None)  # the KV pool's size and state before any request
                self.conn.send(("ready", warmup_s))
                self._loop()
            finally:
                self._compiles.close()

    def _loop(self) -> None:
        while self._take(block=not self.llm.has_unfinished()):
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._deadline = None  # once: the server refuses new requests while it drains
                for rid in list(self._tracked):
                    self.llm.cancel(rid)
            if not self.llm.has_unfinished():
                self._publish(self.llm.take_finished(), None)
                continue
            t0 = time.perf_counter()
            try:
                finished = self.llm.step()
            except EngineDead:
                raise  # engine_main reports it fatal: no later step could run
            except Exception:
                log.exception("engine step failed; its requests end with an error, the service goes on")
                finished = self._fail_running()
            step_s = time.perf_counter() - t0
            compiled = self._compiles.take()
            if compiled:
                sched = self.llm.scheduler
                log.warning("compiled after readiness, in a step of %.1f ms (%d running, %d waiting): %s",
                            step_s * 1e3, len(sched.running), len(sched.waiting), ", ".join(compiled))
            self._publish(finished, step_s)

    def _take(self, block: bool) -> bool:
        """Handle the commands that came in (waiting for one when `block`); False once told to stop or
        once the API process is gone."""
        timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic()) + 0.01
        accepted = []
        try:
            ready = self.conn.poll(timeout if block else 0)
            while ready:
                for kind, arg in self.conn.recv():
                    if kind == "stop":
                        return False
                    if kind == "add":
                        accepted.append(self._add(arg))
                    elif kind == "cancel":
                        for cid in arg:
                            if cid in self._rids:
                                self.llm.cancel(self._rids[cid])
                    elif kind == "drain":
                        self._deadline = time.monotonic() + arg
                ready = self.conn.poll(0)
        except EOFError:
            log.warning("the API process went away; the engine stops")
            return False
        if accepted:  # before the step: a refusal (or the stream's headers) need not wait for it
            self.conn.send(("accepted", accepted))
        return True

    def _add(self, add: Add) -> tuple:
        added = []
        try:
            for cid, p, params in add.choices:
                rid = self.llm.add_request(add.prompts[p], params, logprobs=add.logprobs)
                added.append(rid)
                self._rids[cid] = rid
                self._tracked[rid] = _Tracked(cid, add.logprobs is not None)
        except RequestTooLarge as e:
            return self._refuse(add.key, added, (422, str(e), "max_tokens", "kv_capacity_exceeded"))
        except ValueError as e:
            return self._refuse(add.key, added, (400, str(e), "prompt", None))
        except Exception as e:
            log.exception("admitting a request failed")
            return self._refuse(add.key, added, (500, f"internal error: {type(e).__name__}", None, None))
        return (add.key, None)

    def _refuse(self, key: int, added: list[int], error: tuple) -> tuple:
        for rid in added:
            self.llm.cancel(rid)
            del self._rids[self._tracked.pop(rid).cid]
        self._finished += self.llm.take_finished()  # others' outputs among them are published as usual
        return (key, error)

    def _fail_running(self):
        """After a step raised: requests the scheduler did not end (the failure was outside the engine
        call) are ended here, so none is left running on unknown state."""
        finished = self.llm.take_finished()
        if not any(o.error for o in finished):
            for seq in list(self.llm.scheduler.running):
                self.llm.scheduler.finish(seq, "error", "engine step failed")
            finished += self.llm.take_finished()
        return finished

    def _publish(self, finished, step_s: float | None) -> None:
        """Send the step's `Update`s and `Stats` (wire.py) as plain tuples, in one message."""
        now = time.perf_counter()
        updates = []
        if self._finished:
            finished, self._finished = self._finished + finished, []
        for out in finished:
            tr = self._tracked.pop(out.request_id, None)
            if tr is not None:
                del self._rids[tr.cid]
                lps = out.logprobs[tr.sent:] if tr.logprobs and out.logprobs is not None else None
                updates.append((tr.cid, out.token_ids[tr.sent:], lps, out.finish_reason, out.error, None))
        s = self.llm.scheduler
        for seq in s.running:
            tr = self._tracked.get(seq.seq_id)
            if tr is None:
                continue
            queue_s = None
            if not tr.scheduled:
                tr.scheduled, queue_s = True, now - seq.arrival
            n = len(seq.tokens) - len(seq.prompt)  # tokens generated (seq.output would copy them all)
            if n > tr.sent or queue_s is not None:
                lps = self.llm.token_logprobs(seq.seq_id)[tr.sent:n] if tr.logprobs else None
                updates.append((tr.cid, seq.tokens[len(seq.prompt) + tr.sent:], lps, None, None, queue_s))
                tr.sent = n
        pool = self.llm.pool
        stats = (len(s.running), len(s.waiting), len(s.seqs),
                 sum(len(q.pages.sliding.frames) for q in s.running if q.pages),
                 sum(len(q.pages.full.frames) for q in s.running if q.pages), pool.num_free, pool.num_frames,
                 self._compiles.total)
        self.conn.send(("out", updates, step_s, stats))
