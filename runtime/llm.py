"""`LLM`: the user-facing runtime. Add requests, run steps until done, get outputs back.

One `LLM` owns a frame pool, a scheduler and an engine. The engine is the only thing that differs
between the paged path (`EagerEngine`, or a compiled engine with the same `step`) and the linear
reference (`LinearEngine`); the scheduler and its step batches are identical, which is what makes
paged-vs-linear byte equality a meaningful test (engines/eager.py says why).

The step loop keeps the device busy: `step()` schedules and launches step n+1 (its placeholder
tokens filled on the device from step n's sampled ids, scheduler.py), and only then waits for step
n's ids (one device-to-host copy of the whole step's tokens) and commits them, so scheduling, input
building and output processing of one step run while the device computes the next. Engines that
cannot take device-supplied tokens (`takes_feed` false) run one step at a time.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from g4rt.models.layout import PageGeometry
from g4rt.models.step import to_device

from .arena import Arena, frames_in_budget
from .engines import Engine, Feed
from .engines.eager import EagerEngine, LinearEngine
from .pages import FramePool
from .sampling import BatchSampler, SamplingParams
from .scheduler import ScheduledStep, Scheduler, SchedulerConfig


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None
    ttft_s: float | None  # arrival to first token
    total_s: float  # arrival to finish
    logits: list[torch.Tensor] = field(default_factory=list)  # per sampled token, when recorded
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token, when requested

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.ttft_s is None or len(self.token_ids) < 2 or self.total_s <= self.ttft_s:
            return None
        return (len(self.token_ids) - 1) / (self.total_s - self.ttft_s)


@dataclass
class _Launched:
    """A step on the device: its sampled ids there, their host copy, and the event that copy ends on."""

    step: ScheduledStep
    tokens: torch.Tensor  # int64 [rows] on the engine's device
    host: torch.Tensor  # int64 [rows] on the host (pinned on CUDA)
    done: torch.cuda.Event | None  # None on CPU: the copy is complete when it returns
    logits: torch.Tensor | None = None  # the step's logits rows on the host, when recorded
    logprobs: tuple | None = None  # (rows, chosen, top values, top ids) on the host, when requested


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` copied to the host without waiting (into pinned memory on CUDA): read it once the step's
    event has completed."""
    cuda = t.device.type == "cuda"
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda).copy_(t, non_blocking=cuda)


class LLM:
    """Serve one model. Build with `LLM.paged(...)`, `LLM.reference(...)` or from any `Engine`.

    `record_logits=True` keeps every sampled logits row on the outputs (tests compare them).
    `overlap=False` runs one step at a time even when the engine could overlap (the bench's A/B).
    `kernels` ("triton"|"reference") is the sampler's implementation (BatchSampler), None its default
    for the logits' device; the engine's own choice is made where the engine is built.
    """

    def __init__(self, engine: Engine, num_frames: int, config: SchedulerConfig = SchedulerConfig(),
                 eos_ids=(), shuffle_seed: int | None = None, record_logits: bool = False, overlap: bool = True,
                 kernels: str | None = None):
        self.engine = engine
        self.pool = FramePool(num_frames, shuffle_seed)
        self.scheduler = Scheduler(engine.geometry, self.pool, config)
        self.eos_ids = tuple(eos_ids)
        self.record_logits = record_logits
        self.overlap = overlap and getattr(engine, "takes_feed", False)
        if hasattr(engine, "plan_batches"):
            engine.plan_batches(config.max_num_seqs)  # e.g. CUDA-graph buckets up to what is admitted
        self.sampler = BatchSampler(kernels)
        self._launched: deque[_Launched] = deque()
        self._logits: dict[int, list[torch.Tensor]] = {}
        self._logprobs: dict[int, tuple[int, list]] = {}  # request id -> (top n, entries so far)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def paged(cls, model, *, num_frames: int | None = None, kv_memory_bytes: int | None = None,
              page_tokens: int = 16, device=None, kernels: str | None = None, **kw) -> "LLM":
        """The eager paged engine on the model's device, with an arena of `num_frames` frames
        (or as many as fit in `kv_memory_bytes`); `kernels` ("triton"|"reference") overrides the
        model's choice (`Gemma4Model.set_kernels`) and the sampler's, so one setting covers every op
        of a step."""
        p = next(model.parameters())
        if kernels is not None:
            model.set_kernels(kernels)
        geometry = PageGeometry.build(model.layout, page_tokens)
        if num_frames is None:
            if kv_memory_bytes is None:
                raise ValueError("give num_frames or kv_memory_bytes for the KV arena")
            num_frames = frames_in_budget(kv_memory_bytes, geometry.frame_bytes())
            if num_frames == 0:
                raise ValueError(f"kv_memory_bytes {kv_memory_bytes} holds no frame of {geometry.frame_bytes()} B")
        arena = Arena.for_geometry(geometry, num_frames, device or p.device)
        return cls(EagerEngine(model, geometry, arena), num_frames, eos_ids=model.config.eos_token_ids,
                   kernels=kernels, **kw)

    @classmethod
    def reference(cls, model, *, num_frames: int, page_tokens: int = 16, **kw) -> "LLM":
        """The linear-cache reference behind the same scheduler (`num_frames` only paces admission)."""
        geometry = PageGeometry.build(model.layout, page_tokens)
        return cls(LinearEngine(model, geometry), num_frames, eos_ids=model.config.eos_token_ids, **kw)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, params: SamplingParams = SamplingParams(),
                    logprobs: int | None = None) -> int:
        """Queue a request. `logprobs=n` records, per sampled token, its log-probability under the model
        (log-softmax of the logits) and the n likeliest tokens' (`token_logprobs`, RequestOutput.logprobs).
        `n` is checked here: the top-n of a step is one op over every row that asked, so a bad `n` would
        fail the whole step, every request in it."""
        vocab = self.engine.geometry.layout.config.vocab_size
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= vocab):
            raise ValueError(f"logprobs must be None or an integer in [0, {vocab}] (the vocabulary size), "
                             f"got {logprobs!r}")
        seq = self.scheduler.add(list(prompt_token_ids), params, self.eos_ids)
        if logprobs is not None:
            self._logprobs[seq.seq_id] = (logprobs, [])
        self._logits[seq.seq_id] = []
        return seq.seq_id

    def cancel(self, request_id: int) -> None:
        self.scheduler.cancel(request_id)
        self.engine.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._launched)

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then commit the one before it (with `overlap`; else this one);
        return the requests that finished (cancelled ones included). A scheduling error ends every
        running request (the failed build may have leased pages for any of them) and is raised, as an
        engine error ends the step's requests."""
        try:
            step = self.scheduler.schedule()
        except BaseException as e:
            self._fail(list(self.scheduler.running), e)
            raise
        if step is not None:
            self._launch(step)
        elif self.scheduler.running and not self._launched:
            raise RuntimeError("scheduler made no progress with requests running (a budget bug)")
        while len(self._launched) > (1 if self.overlap and step is not None else 0):
            self._commit_oldest()
        return self.take_finished()

    def _fail(self, seqs, error: BaseException) -> None:
        """End `seqs` with `error`: their pages go back to the pool, the engine drops their state."""
        self.scheduler.fail(seqs, error)
        for seq in seqs:
            self.engine.release(seq.seq_id)

    def _launch(self, step: ScheduledStep) -> None:
        """Queue `step` on the device: the engine's step, the sampler, the copy of the ids to the host."""
        try:
            if step.feed_index:
                prev = self._launched[-1]  # the step whose ids the placeholders are (scheduler.py)
                f = len(step.feed_index)
                index = to_device(torch.tensor(step.feed_index + step.feed_rows), prev.tokens.device)  # one copy
                logits = self.engine.step(step.batch, step.seq_ids, feed=Feed(index[:f], prev.tokens[index[f:]]))
            else:
                logits = self.engine.step(step.batch, step.seq_ids)
            tokens = self.sampler(logits, step.sampling)
            lps = self._queue_logprobs(step, logits, tokens)
            host = _to_host(tokens)
            done = None
            if tokens.device.type == "cuda":  # after every copy of this step, so commit waits for all
                done = torch.cuda.Event()
                done.record()
            kept = logits.float().cpu().clone() if self.record_logits else None
        except BaseException as e:
            self._fail(step.seqs, e)
            raise
        self._launched.append(_Launched(step, tokens, host, done, kept, lps))

    def _queue_logprobs(self, step: ScheduledStep, logits: torch.Tensor, tokens: torch.Tensor):
        """Queue the log-probabilities of the rows whose requests asked for them, and their copies to
        the host (read at commit, after the step's event: no wait for the step launched after it)."""
        rows = [i for i, seq in enumerate(step.sampled) if seq.seq_id in self._logprobs] if self._logprobs else []
        if not rows:
            return None
        idx = to_device(torch.tensor(rows), logits.device)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        k = max(self._logprobs[step.sampled[i].seq_id][0] for i in rows)
        top = lp.topk(k, dim=-1)
        chosen = lp.gather(1, tokens.index_select(0, idx).view(-1, 1).long()).view(-1)
        return rows, _to_host(chosen), _to_host(top.values), _to_host(top.indices)

    def token_logprobs(self, request_id: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """(logprob, [(token id, logprob) of the n likeliest]) per committed token of a request added
        with `logprobs=n`; empty for other requests."""
        return self._logprobs.get(request_id, (0, []))[1]

    def _commit_oldest(self) -> None:
        """Wait for the oldest launched step's copies to the host (its ids, and log-probabilities where
        asked) and commit them."""
        launched = self._launched.popleft()
        try:
            if launched.done is not None:
                launched.done.synchronize()
            tokens = launched.host.tolist()
        except BaseException as e:  # an asynchronous device error surfaces here
            self._fail(launched.step.seqs, e)
            raise
        if launched.logprobs is not None:
            rows, *host = launched.logprobs
            chosen, values, ids = (x.tolist() for x in host)
            for j, i in enumerate(rows):
                seq = launched.step.sampled[i]
                if not seq.finished:
                    n, entries = self._logprobs[seq.seq_id]
                    entries.append((chosen[j], list(zip(ids[j][:n], values[j][:n]))))
        if launched.logits is not None:  # rows of requests still running (not a wasted row after a stop)
            for i, seq in enumerate(launched.step.sampled):
                if not seq.finished:
                    self._logits[seq.seq_id].append(launched.logits[i])
        self.scheduler.commit(launched.step, tokens)

    def take_finished(self) -> list[RequestOutput]:
        """Outputs of requests that ended and were not yet handed out (each is handed out once)."""
        out = []
        for rid, seq in list(self.scheduler.seqs.items()):  # every request not handed out yet
            if seq.finished:
                self.engine.release(rid)
                self.scheduler.forget(rid)
                out.append(RequestOutput(
                    rid, list(seq.prompt), seq.output, seq.finish_reason, seq.error,
                    None if seq.first_token_time is None else seq.first_token_time - seq.arrival,
                    seq.finish_time - seq.arrival, self._logits.pop(rid),
                    logprobs=self._logprobs.pop(rid, (0, None))[1]))
        return out

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] = SamplingParams()) -> list[RequestOutput]:
        """Run `prompts` (lists of token ids) to completion; outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        done: dict[int, RequestOutput] = {}
        with torch.inference_mode():
            while self.has_unfinished():
                for o in self.step():
                    done[o.request_id] = o
        done.update({o.request_id: o for o in self.take_finished()})
        return [done[i] for i in ids]
