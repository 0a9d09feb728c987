"""`LLM`: the user-facing runtime. Add requests, run steps until done, get outputs back.

One `LLM` owns a frame pool, a scheduler and an engine. The engine is the only thing that differs
between the paged path (`EagerEngine`, or a compiled engine with the same `step`) and the linear
reference (`LinearEngine`); the scheduler and its step batches are identical, which is what makes
paged-vs-linear byte equality a meaningful test (engines/eager.py says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from g4rt.models.layout import PageGeometry

from .arena import Arena, frames_in_budget
from .engines import Engine
from .engines.eager import EagerEngine, LinearEngine
from .pages import FramePool
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler, SchedulerConfig, Sequence


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

    @property
    def decode_tokens_per_s(self) -> float | None:
        if self.ttft_s is None or len(self.token_ids) < 2 or self.total_s <= self.ttft_s:
            return None
        return (len(self.token_ids) - 1) / (self.total_s - self.ttft_s)


class LLM:
    """Serve one model. Build with `LLM.paged(...)`, `LLM.reference(...)` or from any `Engine`.

    `record_logits=True` keeps every sampled logits row on the outputs (tests compare them).
    """

    def __init__(self, engine: Engine, num_frames: int, config: SchedulerConfig = SchedulerConfig(),
                 eos_ids=(), shuffle_seed: int | None = None, record_logits: bool = False):
        self.engine = engine
        self.pool = FramePool(num_frames, shuffle_seed)
        self.scheduler = Scheduler(engine.geometry, self.pool, config)
        self.eos_ids = tuple(eos_ids)
        self.record_logits = record_logits
        self._samplers: dict[int, Sampler] = {}
        self._logits: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[int, Sequence] = {}

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def paged(cls, model, *, num_frames: int | None = None, kv_memory_bytes: int | None = None,
              page_tokens: int = 16, device=None, kernels: str | None = None, **kw) -> "LLM":
        """The eager paged engine on the model's device, with an arena of `num_frames` frames
        (or as many as fit in `kv_memory_bytes`); `kernels` ("triton"|"reference") overrides the
        model's choice (`Gemma4Model.set_kernels`)."""
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
        return cls(EagerEngine(model, geometry, arena), num_frames, eos_ids=model.config.eos_token_ids, **kw)

    @classmethod
    def reference(cls, model, *, num_frames: int, page_tokens: int = 16, **kw) -> "LLM":
        """The linear-cache reference behind the same scheduler (`num_frames` only paces admission)."""
        geometry = PageGeometry.build(model.layout, page_tokens)
        return cls(LinearEngine(model, geometry), num_frames, eos_ids=model.config.eos_token_ids, **kw)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, params: SamplingParams = SamplingParams()) -> int:
        seq = self.scheduler.add(list(prompt_token_ids), params, self.eos_ids)
        self._samplers[seq.seq_id] = Sampler(params)
        self._logits[seq.seq_id] = []
        self._pending[seq.seq_id] = seq
        return seq.seq_id

    def cancel(self, request_id: int) -> None:
        self.scheduler.cancel(request_id)
        self.engine.release(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it (cancelled ones included)."""
        step = self.scheduler.schedule()
        if step is not None:
            try:
                logits = self.engine.step(step.batch, step.seq_ids)
            except BaseException as e:
                self.scheduler.fail(step, e)
                for seq in step.seqs:
                    self.engine.release(seq.seq_id)
                raise
            greedy = logits.argmax(dim=-1).tolist()  # one device sync for every greedy row of the step
            tokens = []
            for i, seq in enumerate(step.sampled):
                sampler = self._samplers[seq.seq_id]
                tokens.append(greedy[i] if sampler.params.greedy else sampler(logits[i]))
                if self.record_logits:
                    self._logits[seq.seq_id].append(logits[i].float().cpu().clone())
            self.scheduler.commit(step, tokens)
        elif self.scheduler.running:
            raise RuntimeError("scheduler made no progress with requests running (a budget bug)")
        return self.take_finished()

    def take_finished(self) -> list[RequestOutput]:
        """Outputs of requests that ended and were not yet handed out (each is handed out once)."""
        out = []
        for rid, seq in list(self._pending.items()):
            if seq.finished:
                del self._pending[rid]
                self.engine.release(rid)
                self._samplers.pop(rid)
                self.scheduler.forget(rid)
                out.append(RequestOutput(
                    rid, list(seq.prompt), seq.output, seq.finish_reason, seq.error,
                    None if seq.first_token_time is None else seq.first_token_time - seq.arrival,
                    seq.finish_time - seq.arrival, self._logits.pop(rid)))
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
