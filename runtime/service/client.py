"""The API process's side of the engine process: start it, send it work, read what it sends back.

All of it runs on the event loop, in one thread. The pipe is the loop's transport (`attach`), in the
framing `multiprocessing.Connection` uses on the engine's side (`_Frames`): a command is written at
once (the transport buffers it when the engine, inside a long step, lets its socket buffer fill, so
the loop never blocks on the pipe), and each message from the engine is handled where it arrives:
updates become bytes (outputs.py) and go straight to their streams. With a sender and a reader
thread beside the loop, each request crossed threads twice on its way in and out and waited for the
GIL at each crossing (runtime/results/README.md, "One thread for the pipe").

Waiting requests (for the 429 policy) are counted here: a choice waits from its submission until the
engine's first update for it, i.e. as far as the last report says, not yet started. A dead engine
process (its pipe's end of file without a "stop") fails every request in flight with a 500, turns
readiness and health to 503, logs its exit code, and calls `on_fatal` (the server then shuts down).
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import socket
import struct
import threading
import time

from .engine_loop import engine_main
from .metrics import Metrics
from .outputs import Choice, Job, Outputs
from .protocol import APIError
from .wire import Add, EngineSpec, Stats, Update

log = logging.getLogger("g4rt.serve")


class EngineStartError(RuntimeError):
    """Building the engine failed (the message says why; a traceback, if any, is in the log)."""


def frame(obj) -> bytes:
    """`obj` pickled with multiprocessing.Connection's length prefix: 4 bytes, big-endian and signed,
    or -1 and then 8 unsigned bytes past 2 GiB."""
    data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    n = len(data)
    return (struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + data


class _Frames(asyncio.Protocol):
    """The engine's messages off the event loop's transport, each handed to `on_message` once whole."""

    def __init__(self, on_message, on_lost):
        self.on_message, self.on_lost = on_message, on_lost
        self.buf = bytearray()
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= 4:
            n, head = struct.unpack_from("!i", buf)[0], 4
            if n == -1:
                if len(buf) < 12:
                    return
                n, head = struct.unpack_from("!Q", buf, 4)[0], 12
            if len(buf) < head + n:
                return
            msg = pickle.loads(buf[head:head + n])
            del buf[:head + n]
            self.on_message(msg)

    def connection_lost(self, exc) -> None:
        self.lost.set_result(None)
        self.on_lost()


class EngineClient:
    STOP_TIMEOUT_S = 30.0  # after "stop": the engine leaves its loop at once; a TP engine's ranks need a moment

    def __init__(self, spec: EngineSpec, metrics: Metrics, outputs: Outputs):
        """Start the engine process and wait until it has built its LLM (raises EngineStartError)."""
        self.spec, self.metrics, self.outputs = spec, metrics, outputs
        self.ready = threading.Event()
        self.failed: str | None = None  # why the engine process is gone, once it is
        self.on_fatal = lambda: None  # called on the event loop after `failed` is set
        self.warmup_s: float | None = None
        self.stats = Stats()
        self._jobs: dict[int, Job] = {}  # submitted, not yet accepted
        self._choices: dict[int, Choice] = {}  # cid -> choice, until it finished
        self._waiting: set[int] = set()  # cids submitted and not yet reported started
        self._keys, self._cids = itertools.count(), itertools.count()
        self._transport: asyncio.WriteTransport | None = None
        self._frames: _Frames | None = None
        self._fatal: str | None = None  # the engine loop's last word ("fatal"), before its end of file
        self._stop_sent = False
        self._settled: asyncio.Event | None = None  # set when the engine is ready or gone (wait_ready)
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

    # ---- on the event loop -----------------------------------------------------------------------
    async def attach(self) -> None:
        """Read and write the pipe on the running loop from now on (the server calls it first)."""
        self._settled = asyncio.Event()
        sock = socket.socket(fileno=os.dup(self._conn.fileno()))  # the transport's own: closing it keeps ours
        self._transport, self._frames = await asyncio.get_running_loop().create_unix_connection(
            lambda: _Frames(self._message, self._lost), sock=sock)

    async def detach(self) -> None:
        """Send "stop" and let it reach the pipe; the loop reads no more (the server calls it last)."""
        if self._transport is None or self._transport.is_closing():
            return
        self._send(("stop", None))
        self._stop_sent = True
        for _ in range(1000):  # up to 2 s: the engine reads between steps, which take far less
            if not self._transport.get_write_buffer_size():
                break
            await asyncio.sleep(0.002)
        self._transport.close()
        await self._frames.lost

    async def wait_ready(self) -> bool:
        """Wait until the engine reports ready (True) or is gone (False)."""
        await self._settled.wait()
        return self.failed is None and self.ready.is_set()

    def submit(self, job: Job) -> None:
        if self.failed is not None:  # it died after the caller checked readiness: never leave a job waiting
            raise APIError(503, self.failed, code="engine_failed")
        for c in job.choices:
            c.cid = next(self._cids)
            self._choices[c.cid] = c
            self._waiting.add(c.cid)
        key = next(self._keys)
        self._jobs[key] = job
        self._send(("add", Add(key, job.spec.prompts, [(c.cid, p, params) for c, (p, params)
                                                       in zip(job.choices, job.spec.choices)],
                               job.spec.logprobs)))

    def cancel(self, cids: list[int]) -> None:
        if cids and self.failed is None:
            self._send(("cancel", cids))

    def drain(self, timeout_s: float) -> None:
        """Let running requests finish for `timeout_s`, then end them (their streams get a final chunk)."""
        self._send(("drain", timeout_s))

    def num_waiting(self) -> int:
        return len(self._waiting)

    def _send(self, command: tuple) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame([command]))

    def _message(self, msg: tuple) -> None:
        kind, *args = msg
        try:
            if kind == "out":
                self._out(*args)
            elif kind == "accepted":
                self._accepted(args[0])
            elif kind == "ready":
                self.warmup_s = args[0]
                self.ready.set()
                self._settled.set()
            elif kind == "fatal":
                self._fatal = f"the engine loop died: {args[0]}"
        except Exception as e:  # a bug here would leave every request waiting: fail them instead
            log.exception("handling the engine's message failed")
            self._fatal = f"the API process could not handle the engine's messages: {type(e).__name__}: {e}"
            self.proc.kill()

    def _lost(self) -> None:
        """The pipe's end of file: after "stop" the end of the service, otherwise the engine's death."""
        if self._stop_sent:
            return
        asyncio.get_running_loop().create_task(self._engine_died())

    async def _engine_died(self) -> None:
        reason = self._fatal or "the engine process died"
        self.failed = reason  # from now on, new requests get 503
        self._settled.set()
        code = await asyncio.to_thread(self._join, 5)
        self.failed = f"{reason} (exit code {code})"
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

    # ---- any thread, once the loop is gone -------------------------------------------------------
    def close(self) -> None:
        """Stop the engine process and wait for it (`spec.after` runs there first, unbounded); idempotent.
        Without `detach` (no loop ever ran, or it died) "stop" goes on the pipe from here."""
        if self._conn.closed:
            return
        atexit.unregister(self.close)
        fd = self._conn.fileno()
        os.set_blocking(fd, True)  # the transport's socket shares the flag
        if not self._stop_sent and self.proc.is_alive() and self.failed is None:
            try:
                self._conn.send([("stop", None)])
                self._stop_sent = True
            except OSError:
                pass
        if self._stop_sent and self.proc.is_alive():
            self._discard_until_exit(None if self.spec.after else self.STOP_TIMEOUT_S)
        if self.proc.is_alive():
            log.warning("the engine process did not stop; terminating it")
            self.proc.terminate()
            if self._join(5) is None:
                self.proc.kill()
        self._join(10)
        self._conn.close()

    def _discard_until_exit(self, timeout: float | None) -> None:
        """Read (and drop) what the engine still sends until it exits, so no send of its blocks."""
        end = None if timeout is None else time.monotonic() + timeout
        fd, eof = self._conn.fileno(), False
        while self.proc.is_alive() and (end is None or time.monotonic() < end):
            if eof:
                self._join(0.05)
            elif self._conn.poll(0.05):
                eof = not os.read(fd, 1 << 20)

    def _join(self, timeout: float | None) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode
