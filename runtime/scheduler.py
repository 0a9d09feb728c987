"""Continuous batching: each step mixes decode tokens and prefill chunks under a token budget.

Policy (first come, first served, no preemption):

1. running requests, oldest first, each get the rest of their known-but-uncomputed tokens, capped by
   the prefill chunk and what remains of `max_num_batched_tokens` (a decoding request takes 1);
2. then waiting requests are admitted in arrival order while their promise (admission.py) fits the
   pool's unpromised frames and `max_num_seqs`; the first that does not fit stops admission, so a
   large request is not starved by a stream of small ones behind it.

Promises are taken at admission, so a running request can always lease its next pages and nothing
is ever preempted. The scheduler builds the `StepBatch` (int32, both groups' tables and slots) and a
`logits_rows` entry for every sequence whose step ends at the end of its known tokens; `commit`
appends the sampled tokens and applies stop conditions.

One step may be in flight while the next is scheduled (llm.py overlaps them): a sequence whose last
token was sampled on the device but not yet seen by the host (`inflight`) is scheduled as usual, its
unknown token a placeholder the engine fills on the device from the previous step's sampled ids
(`ScheduledStep.feed_index` / `feed_rows`). So `computed` advances when a step is built, and pages
no later step reads go back right after the build: a frame freed then can only be written by a later
step, which the device runs after the in-flight one. A request stopped by a token the host has not
seen yet costs one wasted row in the next step; one that reaches max_new_tokens is not scheduled again.
"""
from __future__ import annotations

import itertools
import time
from array import array
from collections import deque
from dataclasses import dataclass, field

import torch

from g4rt.models.layout import PageGeometry
from g4rt.models.step import StepBatch

from .admission import check_fits, promise_for
from .pages import FramePool, FullGroup, RequestPages, SlidingGroup
from .sampling import SamplingParams, SamplingRows, request_seed


@dataclass(frozen=True)
class SchedulerConfig:
    """Capacity knobs. `chunk` bounds the tokens one request computes in a step and is charged to
    every request's sliding promise; `max_num_batched_tokens` bounds a step's total tokens."""

    max_num_batched_tokens: int = 512
    chunk: int = 256
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "chunk", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.chunk > self.max_num_batched_tokens:
            raise ValueError(f"chunk ({self.chunk}) must not exceed max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})")

    @classmethod
    def for_device(cls, device, **overrides) -> "SchedulerConfig":
        """Measured settings per device kind (`overrides` win). CUDA: a 2,048-token chunk and budget
        (31B on the H200: time to first token of 8k tokens within 1.5 % of one 8k step, where 512 costs
        4-12 %, and a running decode waits at most one ~0.25 s step; export/results) and 256 sequences,
        the largest decode graph. Other devices: the class defaults. The chunk is also charged to every
        request's sliding promise (admission.py), so a larger one admits fewer long requests."""
        kind = torch.device(device).type
        base = {"max_num_batched_tokens": 2048, "chunk": 2048, "max_num_seqs": 256} if kind == "cuda" else {}
        return cls(**{**base, **overrides})


# A built engine's recorded limits (its manifest's "limits", models/profiles.py StepLimits) -> the
# SchedulerConfig field each one bounds. Frames (max_frames) bound the arena, not the scheduler.
LIMIT_FIELDS = {"max_batched_tokens": "max_num_batched_tokens", "chunk": "chunk", "max_seqs": "max_num_seqs",
                "max_model_len": "max_model_len"}


def engine_limits(manifest: dict) -> dict[str, int]:
    """The scheduler settings a built engine was built for, by SchedulerConfig's field names: a compiled
    engine (TensorRT) runs only steps inside the profile derived from them, so a scheduler over it must
    stay within them. Empty for an engine built without limits."""
    limits = manifest.get("limits") or {}
    return {field: limits[key] for key, field in LIMIT_FIELDS.items() if key in limits}


@dataclass
class Sequence:
    """One request's state. `tokens` = prompt + generated; `computed` = positions in the cache."""

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    pages: RequestPages | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    seed: int = 0  # the sampling stream's seed (sampling.py)
    inflight: int = 0  # tokens sampled on the device that the host has not committed yet (0 or 1)
    feed_row: int = -1  # while inflight: the row of the in-flight step's sampled ids holding the token

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    @property
    def draws(self) -> int:
        """Tokens sampled so far, committed or in flight: the counter of the next draw's noise."""
        return len(self.tokens) - len(self.prompt) + self.inflight


@dataclass
class ScheduledStep:
    """A step's batch plus what the runtime needs to apply its result."""

    batch: StepBatch
    seqs: list[Sequence]  # batch order
    sampled: list[Sequence]  # sequences owning logits_rows, in row order
    sampling: SamplingRows  # their sampling settings, row order
    feed_index: list[int] = field(default_factory=list)  # flat tokens whose ids the device supplies
    feed_rows: list[int] = field(default_factory=list)  # ... from these rows of the previous step's ids

    @property
    def seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.seqs]


class Scheduler:
    def __init__(self, geometry: PageGeometry, pool: FramePool, config: SchedulerConfig = SchedulerConfig()):
        self.geometry, self.pool, self.config = geometry, pool, config
        self.groups = (SlidingGroup(geometry, pool), FullGroup(geometry, pool))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        """The most positions (prompt + output) one request may use: the config's limit, else the
        model's max_position_embeddings (positions past it are beyond what the model was trained for)."""
        return self.config.max_model_len or self.geometry.layout.config.max_position_embeddings

    # ---- requests ------------------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams, eos_ids=()) -> Sequence:
        """Queue a request; raise `RequestTooLarge` if it could never run, ValueError on bad input."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must hold at least one token id")
        model_cfg = self.geometry.layout.config
        bad = [t for t in prompt if not 0 <= t < model_cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {model_cfg.vocab_size})")
        total = len(prompt) + params.max_new_tokens
        limit = self.max_model_len
        if total > limit:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) = {total} "
                             f"exceeds max_model_len {limit}")
        check_fits(self._promise(len(prompt), params), self.pool.num_frames, len(prompt),
                   params.max_new_tokens, self.config.chunk)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        seq = Sequence(next(self._ids), prompt, params, frozenset(stops), tokens=list(prompt),
                       seed=request_seed(params))
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def _promise(self, prompt_len: int, params: SamplingParams):
        return promise_for(self.geometry, prompt_len, params.max_new_tokens, self.config.chunk)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def cancel(self, seq_id: int) -> None:
        """End a request; a no-op for one already finished and forgotten."""
        if seq_id in self.seqs:
            self.finish(self.seqs[seq_id], "cancelled")

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's state once its output was handed out (a long-running service
        would otherwise keep every request it ever served)."""
        if not self.seqs[seq_id].finished:
            raise ValueError(f"request {seq_id} is still running")
        del self.seqs[seq_id]

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a request for any reason; its pages and promise go back to the pool at once."""
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.pages is not None:
            seq.pages.release()
        seq.status, seq.finish_reason, seq.error = "finished", reason, error
        seq.finish_time = time.perf_counter()

    def fail(self, seqs, error: BaseException) -> None:
        """A step (or building one) failed: end `seqs` with the error (their cache contents are unknown)."""
        for seq in seqs:
            self.finish(seq, "error", f"{type(error).__name__}: {error}")

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """Choose this step's work and build its batch; None when nothing can run."""
        budget = self.config.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if seq.inflight and len(seq.output) + seq.inflight >= seq.params.max_new_tokens:
                continue  # its in-flight token is its last: it finishes when that is committed
            n = min(len(seq.tokens) + seq.inflight - seq.computed, self.config.chunk, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            promise = self._promise(len(seq.prompt), seq.params)
            if not self.pool.can_reserve(promise.frames):
                break  # FCFS: it waits for pages to come back; nothing behind it jumps ahead
            self.waiting.popleft()
            seq.pages = RequestPages(self.geometry, self.pool, promise.frames, self.groups)
            seq.status = "running"
            self.running.append(seq)
            n = min(len(seq.tokens), self.config.chunk, budget)
            plan.append((seq, n))
            budget -= n
        if not plan:
            return None
        return self._build(plan)

    def _build(self, plan: list[tuple[Sequence, int]]) -> ScheduledStep:
        token_ids, positions, s_slots, f_slots, rows, sampled = [], [], [], [], [], []
        cu_q, kv_lens, s_rows, s_first, f_rows = [0], [], [], [], []
        feed_index, feed_rows = [], []
        for seq, n in plan:
            start = seq.computed
            span = range(start, start + n)
            seq.pages.prepare(start, n)  # leases within the promise; PastPagesError if impossible
            known = seq.tokens[start:start + n]
            if len(known) < n:  # the last token is the in-flight one: the device supplies it
                feed_index.append(len(token_ids) + len(known))
                feed_rows.append(seq.feed_row)
                known.append(0)
            token_ids += known
            positions += list(span)
            s_slots += seq.pages.slots("sliding", span)
            f_slots += seq.pages.slots("full", span)
            cu_q.append(cu_q[-1] + n)
            kv_lens.append(start + n)
            s_rows.append(seq.pages.sliding.frames)
            s_first.append(seq.pages.sliding.first_page)
            f_rows.append(seq.pages.full.frames)
            if start + n == len(seq.tokens) + seq.inflight:
                rows.append(cu_q[-1] - 1)
                sampled.append(seq)

        def table(rows_: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(r) for r in rows_))
            return torch.tensor([r + [0] * (width - len(r)) for r in rows_], dtype=torch.int32)

        def i32(x: list[int]) -> torch.Tensor:  # through an array: a third of torch.tensor's time for 8k ints
            return torch.frombuffer(array("i", x), dtype=torch.int32) if x else torch.zeros(0, dtype=torch.int32)

        batch = StepBatch(i32(token_ids), i32(positions), i32(cu_q), i32(kv_lens), table(s_rows), i32(s_first),
                          i32(s_slots), table(f_rows), i32(f_slots), i32(rows))
        sampling = SamplingRows([s.params.temperature for s in sampled], [s.params.top_k for s in sampled],
                                [s.params.top_p for s in sampled], [s.seed for s in sampled],
                                [s.draws for s in sampled])
        for seq, n in plan:
            seq.computed += n
        for row, seq in enumerate(sampled):
            seq.inflight += 1
            seq.feed_row = row
        for seq, _ in plan:  # after every lease of this step, so no frame it reads is re-leased in it
            seq.pages.trim(seq.computed)
        return ScheduledStep(batch, [s for s, _ in plan], sampled, sampling, feed_index, feed_rows)

    def commit(self, step: ScheduledStep, new_tokens: list[int]) -> list[Sequence]:
        """Apply a finished step: `new_tokens[i]` is the token sampled for `step.sampled[i]`.
        Returns the requests that finished in this step."""
        if len(new_tokens) != len(step.sampled):
            raise ValueError(f"commit got {len(new_tokens)} tokens for {len(step.sampled)} logits rows")
        done = []
        now = time.perf_counter()
        for seq, tok in zip(step.sampled, new_tokens):
            seq.inflight -= 1
            if seq.finished:  # cancelled, failed or stopped while the step ran
                continue
            seq.tokens.append(int(tok))
            seq.first_token_time = seq.first_token_time or now
            if int(tok) in seq.stop_ids:
                self.finish(seq, "stop")
            elif len(seq.output) >= seq.params.max_new_tokens:
                self.finish(seq, "length")
            if seq.finished:
                done.append(seq)
        return done
