"""What crosses the boundary between the API process and the engine process.

The engine runs in its own process so that its step loop never waits for the API process's Python
(JSON, SSE writes, detokenizing hold that process's GIL). The two talk over one duplex pipe
(`multiprocessing.Pipe`, a socketpair) with pickled messages of plain values, no tensors (so no
shared memory to leak): the API process sends lists of commands, the engine process answers with
one message per loop iteration that carries every request's new tokens at once, so the transport
costs one send per step, not one per token.

API -> engine, each message a list of commands:
    ("add", Add)          a job's choices; answered in an "accepted" message
    ("cancel", [cid])     end these choices now (their pages go back at once)
    ("drain", seconds)    let running choices finish for that long, then end them
    ("stop", None)        leave the loop; the process exits

Engine -> API, each message one tuple:
    ("built", info)       the LLM exists (info: max_model_len, num_frames, max_num_seqs, engine, pid)
    ("failed", message)   building the LLM failed; the process exits
    ("ready", warmup_s)   warm-up done: requests may come
    ("accepted", [(key, error or None)])   admissions (error: (status, message, param, code))
    ("out", [Update], step_s, Stats)       after a step (step_s None: no step ran), as plain tuples
    ("fatal", message)    the loop died (its traceback is in the engine's log)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


@dataclass(frozen=True)
class EngineSpec:
    """How the engine process gets its `LLM`: `build()` is called there, so it must be picklable (a
    module-level function, or a `functools.partial` of one with picklable arguments). `after(llm)`, when
    given, runs there once the service has stopped: a benchmark's offline arm reuses the warmed-up engine."""

    build: Callable[[], Any]
    after: Callable[[Any], None] | None = None


class Add(NamedTuple):
    """One HTTP request's engine work: `choices[i] = (cid, prompt index, SamplingParams)`."""

    key: int
    prompts: list[list[int]]
    choices: list[tuple]
    logprobs: int | None


class Update(NamedTuple):
    """New tokens of one choice after a step; `finish_reason`/`error` once it ended; `queue_s` on the
    first update after it was first scheduled (arrival in the engine to first step). Sent as a plain
    tuple in this field order (`Update._make` on arrival): a NamedTuple pickles as its class and a call
    to it, several times the cost of a plain tuple, and a step sends one per running choice."""

    cid: int
    token_ids: list[int]
    logprobs: list | None  # per token: (logprob, [(id, logprob), ...]) when requested
    finish_reason: str | None = None
    error: str | None = None
    queue_s: float | None = None


class Stats(NamedTuple):
    """The engine's state after an iteration (readiness, /metrics)."""

    running: int = 0
    waiting: int = 0
    requests: int = 0  # requests the engine holds (running, waiting or finished and not yet handed out)
    sliding_used: int = 0  # KV frames leased by running requests, per cache group
    full_used: int = 0
    free: int = 0
    total: int = 0
    compiles: int = 0  # kernels and graphs compiled after readiness (engine_loop.CompileWatch)
