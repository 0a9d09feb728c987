"""The engine thread: the only code that touches the `LLM`.

It warms the engine up (every decode graph the scheduler can ask for, then a few real requests
through the whole path) before it reports ready, then steps whenever there is work. Between steps it
takes new requests and cancellations from a queue; after each step it hands the new tokens to the
output thread. A step that raises fails the requests it held (the scheduler ends them with the error)
and the loop goes on with the rest.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from ..admission import RequestTooLarge
from ..llm import LLM
from ..sampling import SamplingParams
from .metrics import Metrics
from .outputs import Choice, Job, OutputThread, Update, accept
from .protocol import APIError

log = logging.getLogger("g4rt.serve")


def decode_bounds(llm: LLM) -> dict:
    """The largest decode batch and page-table widths this scheduler can produce (warm-up covers them)."""
    sched = llm.scheduler
    geo = sched.geometry
    max_len = llm.scheduler.max_model_len
    pt_s, pt_f = geo.page_tokens["sliding"], geo.page_tokens["full"]
    window = geo.layout.sliding.window
    sliding = min(-(-max_len // pt_s), -(-(window - 1) // pt_s) + 1)
    return {"max_seqs": sched.config.max_num_seqs, "max_sliding_pages": sliding,
            "max_full_pages": -(-max_len // pt_f)}


def warm_up(llm: LLM) -> float:
    """Everything a first request would otherwise pay for: the engine's own warm-up (every decode graph
    within `decode_bounds`), then prompts through the whole step path, each alone (a single-sequence
    prefill) and all together (a multi-sequence prefill, mixed steps, decode), greedy and sampled.
    Their lengths cover sizes compilers commonly specialise on (1, a multiple of 16 and not, a full chunk).
    Returns the seconds it took.

    On the H200 (runtime/results/README.md, the `g4rt serve` section) the first request after a warm-up
    of only the batch together still took 2.3 s to its first token against <= 70 ms for the next nine;
    with the single-sequence prefills it took 78.6 ms (the cause was not isolated)."""
    t0 = time.perf_counter()
    if hasattr(llm.engine, "warmup"):
        llm.engine.warmup(**decode_bounds(llm))
    sched = llm.scheduler
    max_len = llm.scheduler.max_model_len
    vocab = sched.geometry.layout.config.vocab_size
    lens = sorted({max(1, min(n, max_len - 4)) for n in (sched.config.chunk + 1, 48, 17, 2)}, reverse=True)
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in lens]
    greedy = SamplingParams(max_new_tokens=3, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=5, seed=0, ignore_eos=True)
    for p in prompts:
        llm.generate([p], greedy)
    llm.generate(prompts, [greedy, sampled] * (len(prompts) // 2) + [greedy] * (len(prompts) % 2))
    seconds = time.perf_counter() - t0
    log.info("warm-up done in %.1f s", seconds)
    return seconds


class _Tracked:
    __slots__ = ("choice", "sent", "scheduled", "logprobs")

    def __init__(self, choice: Choice, logprobs: bool):
        self.choice, self.sent, self.scheduled, self.logprobs = choice, 0, False, logprobs


class EngineLoop:
    def __init__(self, llm: LLM, outputs: OutputThread, metrics: Metrics, warmup: bool = True):
        self.llm, self.outputs, self.metrics, self.warmup = llm, outputs, metrics, warmup
        self.ready = threading.Event()
        self.failed: BaseException | None = None  # set when the loop itself died (warm-up or a bug)
        self.on_fatal = lambda: None  # called from the engine thread after `failed` is set
        self.warmup_s: float | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[int, _Tracked] = {}
        self._deadline: float | None = None  # drain: abort what still runs at this time
        self._thread = threading.Thread(target=self._run, name="g4rt-engine", daemon=True)

    # ---- any thread ------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        self._inbox.put(("add", job))

    def cancel(self, rids: list[int]) -> None:
        if rids:
            self._inbox.put(("cancel", rids))

    def drain(self, timeout_s: float) -> None:
        """Let running requests finish for `timeout_s`, then end them (their streams get a final chunk)."""
        self._inbox.put(("drain", time.monotonic() + timeout_s))

    def close(self) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)

    def num_waiting(self) -> int:
        """Requests not yet running (queued in the scheduler or not yet taken from the inbox)."""
        return len(self.llm.scheduler.waiting) + self._inbox.qsize()

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            log.exception("the engine loop stopped; the service cannot go on")
            self.failed = e
            self.on_fatal()

    def _serve(self) -> None:
        with torch.inference_mode():
            if self.warmup:
                self.warmup_s = warm_up(self.llm)
            self.ready.set()
            self.metrics.ready.set(1)
            while self._take(block=not self.llm.has_unfinished()):
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    for rid in list(self._tracked):
                        self.llm.cancel(rid)
                if not self.llm.has_unfinished():
                    self._publish(self.llm.take_finished())
                    continue
                t0 = time.perf_counter()
                try:
                    finished = self.llm.step()
                except Exception:
                    log.exception("engine step failed; its requests end with an error, the service goes on")
                    finished = self._fail_running()
                self.metrics.step.observe(time.perf_counter() - t0)
                self._publish(finished)

    def _take(self, block: bool) -> bool:
        """Handle queued commands; False once asked to stop."""
        timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic()) + 0.01
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            while True:
                if item[0] == "stop":
                    return False
                self._handle(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _handle(self, item) -> None:
        kind, arg = item
        if kind == "drain":
            self._deadline = arg
        elif kind == "cancel":
            for rid in arg:
                if rid in self._tracked:
                    self.llm.cancel(rid)
        else:
            self._add(arg)

    def _add(self, job: Job) -> None:
        added = []
        try:
            for choice, (p, params) in zip(job.choices, job.spec.choices):
                rid = self.llm.add_request(job.spec.prompts[p], params, logprobs=job.spec.logprobs)
                choice.rid = rid
                added.append(rid)
                self._tracked[rid] = _Tracked(choice, job.spec.logprobs is not None)
        except RequestTooLarge as e:
            self._refuse(job, added, APIError(422, str(e), "max_tokens", "kv_capacity_exceeded"))
        except ValueError as e:
            self._refuse(job, added, APIError(400, str(e), "prompt"))
        except Exception as e:
            log.exception("admitting a request failed")
            self._refuse(job, added, APIError(500, f"internal error: {type(e).__name__}"))
        else:
            self.metrics.prompt_tokens.inc(sum(len(job.spec.prompts[p]) for p, _ in job.spec.choices))
            accept(job)

    def _refuse(self, job: Job, added: list[int], err: APIError) -> None:
        for rid in added:
            self.llm.cancel(rid)
            del self._tracked[rid]
        self.llm.take_finished()
        accept(job, err)

    def _fail_running(self):
        """After a step raised: requests the scheduler did not end (the failure was outside the engine
        call) are ended here, so none is left running on unknown state."""
        finished = self.llm.take_finished()
        if not any(o.error for o in finished):
            for seq in list(self.llm.scheduler.running):
                self.llm.scheduler.finish(seq, "error", "engine step failed")
            finished += self.llm.take_finished()
        return finished

    def _publish(self, finished) -> None:
        now = time.perf_counter()
        updates = []
        for out in finished:
            tr = self._tracked.pop(out.request_id, None)
            if tr is not None:
                lps = out.logprobs[tr.sent:] if tr.logprobs and out.logprobs is not None else None
                updates.append(Update(tr.choice, out.token_ids[tr.sent:], lps, out.finish_reason, out.error))
        for seq in self.llm.scheduler.running:
            tr = self._tracked.get(seq.seq_id)
            if tr is None:
                continue
            queue_s = None
            if not tr.scheduled:
                tr.scheduled, queue_s = True, now - seq.arrival
            tokens = seq.output
            if len(tokens) > tr.sent or queue_s is not None:
                lps = self.llm.token_logprobs(seq.seq_id)[tr.sent:len(tokens)] if tr.logprobs else None
                updates.append(Update(tr.choice, tokens[tr.sent:], lps, queue_s=queue_s))
                tr.sent = len(tokens)
        if updates:
            self.outputs.put(updates)
        self._gauges()

    def _gauges(self) -> None:
        m, s, pool = self.metrics, self.llm.scheduler, self.llm.pool
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting))
        m.frames.labels("sliding", "used").set(sum(len(q.pages.sliding.frames) for q in s.running if q.pages))
        m.frames.labels("full", "used").set(sum(len(q.pages.full.frames) for q in s.running if q.pages))
        m.frames.labels("all", "free").set(pool.num_free)
        m.frames.labels("all", "total").set(pool.num_frames)
