"""The API process's side of the engine process: start it, send it work, read what it sends back.

Three threads of this process touch the pipe, each for one thing: the event loop only puts commands
on a queue (it never blocks on the pipe, even when the engine is inside a long step and its socket
buffer is full), the **sender thread** sends whatever is queued as one message, and the **reader
thread** receives the engine's messages and turns updates into bytes (outputs.py) for the event loop.

Waiting requests (for the 429 policy) are counted here: a choice waits from its submission until the
engine's first update for it, i.e. as far as the last report says, not yet started. A dead engine
process (its pipe's end of file without a "stop") fails every request in flight with a 500, turns
readiness and health to 503, logs its exit code, and calls `on_fatal` (the server then shuts down).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import queue
import threading

from .engine_loop import engine_main
from .metrics import Metrics
from .outputs import Choice, Job, Outputs
from .protocol import APIError
from .wire import Add, EngineSpec, Stats, Update

log = logging.getLogger("g4rt.serve")


class EngineStartError(RuntimeError):
    """Building the engine failed (the message says why; a traceback, if any, is in the log)."""


class EngineClient:
    STOP_TIMEOUT_S = 30.0  # after "stop": the engine leaves its loop at once; a TP engine's ranks need a moment

    def __init__(self, spec: EngineSpec, metrics: Metrics, outputs: Outputs):
        """Start the engine process and wait until it has built its LLM (raises EngineStartError)."""
        self.spec, self.metrics, self.outputs = spec, metrics, outputs
        self.ready = threading.Event()
        self.failed: str | None = None  # why the engine process is gone, once it is
        self.on_fatal = lambda: None  # called on the reader thread after `failed` is set
        self.warmup_s: float | None = None
        self.stats = Stats()
        self._jobs: dict[int, Job] = {}  # submitted, not yet accepted
        self._choices: dict[int, Choice] = {}  # cid -> choice, until it finished
        self._waiting: set[int] = set()  # cids submitted and not yet reported started
        self._keys, self._cids = itertools.count(), itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._sender: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not a daemon: a tensor-parallel engine starts its rank processes from it
        self.proc = ctx.Process(target=engine_main, name="g4rt-engine", daemon=False,
                                args=(child, spec, logging.getLogger().getEffectiveLevel()))
        self.proc.start()
        child.close()  # the engine's end lives in the engine alone, so its exit is this end's EOF
        atexit.register(self.close)
        try:
            kind, arg = self._conn.recv()
        except (EOFError, OSError):
            kind, arg = "failed", f"the engine process exited with code {self._join(10)} before building"
        if kind != "built":
            self._join(10)
            self.close()
            raise EngineStartError(arg)
        self.info = arg
        log.info("engine process %d: %s", arg["pid"], arg["engine"])
        self._sender = threading.Thread(target=self._send_loop, name="g4rt-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="g4rt-outputs", daemon=True)
        self._sender.start()
        self._reader.start()

    # ---- any thread ------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        for c in job.choices:
            c.cid = next(self._cids)
            self._choices[c.cid] = c
            self._waiting.add(c.cid)
        key = next(self._keys)
        self._jobs[key] = job
        self._outbox.put(("add", Add(key, job.spec.prompts, [(c.cid, p, params) for c, (p, params)
                                                             in zip(job.choices, job.spec.choices)],
                                     job.spec.logprobs)))
        if self.failed is not None:  # it died after the caller checked readiness: never leave a job waiting
            raise APIError(503, self.failed, code="engine_failed")

    def cancel(self, cids: list[int]) -> None:
        if cids and self.failed is None:
            self._outbox.put(("cancel", cids))

    def drain(self, timeout_s: float) -> None:
        """Let running requests finish for `timeout_s`, then end them (their streams get a final chunk)."""
        self._outbox.put(("drain", timeout_s))

    def num_waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        """Stop the engine process and wait for it (`spec.after` runs there first, unbounded); idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.put(("stop", None))
        if self.proc.is_alive() and self.failed is None and self._sender is not None:
            self._sender.join(5)
            self._join(None if self.spec.after else self.STOP_TIMEOUT_S)
        if self.proc.is_alive():
            log.warning("the engine process did not stop; terminating it")
            self.proc.terminate()
            if self._join(5) is None:
                self.proc.kill()
        self._join(10)
        if self._reader is not None:
            self._reader.join(5)
        self._conn.close()
        atexit.unregister(self.close)

    def _join(self, timeout: float | None) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    # ---- the sender thread -----------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._conn.send(batch)
            except (OSError, ValueError):
                return  # the engine is gone: the reader reports it
            if any(kind == "stop" for kind, _ in batch):
                return

    # ---- the reader thread -----------------------------------------------------------------------
    def _read_loop(self) -> None:
        reason = None
        try:
            while True:
                kind, *args = self._conn.recv()
                if kind == "out":
                    self._out(*args)
                elif kind == "accepted":
                    self._accepted(args[0])
                elif kind == "ready":
                    self.warmup_s = args[0]
                    self.ready.set()
                    self.metrics.ready.set(1)
                elif kind == "fatal":
                    reason = f"the engine loop died: {args[0]}"
        except (EOFError, OSError):
            pass
        except Exception as e:  # a bug here would leave every request waiting: fail them instead
            log.exception("reading the engine's messages failed")
            reason = f"the API process could not read the engine's messages: {type(e).__name__}: {e}"
            self.proc.kill()
        if self._stopping and reason is None:
            return
        code = self._join(5)
        self.failed = f"{reason or 'the engine process died'} (exit code {code})"
        log.error("%s; failing every request in flight, the service cannot go on", self.failed)
        self.metrics.ready.set(0)
        err = APIError(500, self.failed, code="engine_failed")
        running = dict.fromkeys(c.job for c in list(self._choices.values()))
        self.outputs.fail(list(self._jobs.values()) + list(running), err)
        self._waiting.clear()
        self.on_fatal()

    def _accepted(self, accepted: list) -> None:
        jobs = []
        for key, err in accepted:
            job = self._jobs.pop(key)
            if err is None:
                self.metrics.prompt_tokens.inc(sum(len(job.spec.prompts[p]) for p, _ in job.spec.choices))
            else:
                for c in job.choices:
                    del self._choices[c.cid]
                    self._waiting.discard(c.cid)
                err = APIError(*err)
            jobs.append((job, err))
        self.outputs.apply([], jobs)

    def _out(self, updates: list, step_s: float | None, stats: tuple) -> None:
        pairs = []
        for t in updates:
            u = Update._make(t)
            c = self._choices.get(u.cid)
            if c is None:
                continue
            self._waiting.discard(u.cid)
            if u.finish_reason is not None:
                del self._choices[u.cid]
            pairs.append((c, u))
        if pairs:
            self.outputs.apply(pairs)
        m = self.metrics
        if step_s is not None:
            m.step.observe(step_s)
        stats = Stats._make(stats)
        if stats.compiles > self.stats.compiles:
            m.compiles.inc(stats.compiles - self.stats.compiles)
        self.stats = stats
        m.running.set(stats.running)
        m.waiting.set(stats.waiting)
        m.frames.labels("sliding", "used").set(stats.sliding_used)
        m.frames.labels("full", "used").set(stats.full_used)
        m.frames.labels("all", "free").set(stats.free)
        m.frames.labels("all", "total").set(stats.total)
