"""Engines: what turns one `StepBatch` into logits, and `open_engine`, which opens a built one.

`Engine` is the protocol every backend meets:

    geometry: PageGeometry
    config: Gemma4Config
    step(batch: StepBatch, seq_ids: list[int]) -> float32 logits [len(batch.logits_rows), V]
    release(seq_id) -> None          # a request ended; drop any per-request state

An engine with `takes_feed = True` also accepts `step(..., feed=Feed)`: token ids the device
supplies, so the runtime can schedule a step before it has seen the previous step's ids
(runtime/llm.py). The logits may be a view valid until the next step.

An engine may also offer `plan_batches(max_batch)`: the largest batch the scheduler admits, which
LLM passes at construction (CUDA-graph buckets up to it, inductor.py), and
`warmup(max_seqs, max_sliding_pages, max_full_pages, max_tokens)`: do before the first
request whatever a step of those bounds would otherwise do on first use (CUDA-graph capture); the
service calls it before it reports ready (runtime/service/engine_loop.py). Eager engines need none.

Backends: `EagerEngine` (the model in torch over the paged arena) and `LinearEngine` (the contiguous
reference cache) run a model in memory (eager.py); `OrtEngine` (onnxruntime.py), `InductorEngine`
(inductor.py) and `TrtEngine` (tensorrt.py) run an engine directory that `g4rt build` wrote, picked
by its manifest's `backend`. Each backend module imports its own optional dependency, so opening one
kind never needs another's.

An engine that can run no further step raises `EngineDead` from `step` (a tensor-parallel engine once a
rank failed, parallel.py): the service then stops instead of failing every later request
(runtime/service/engine_loop.py). Any other exception from `step` fails that step's requests only.

Paged engines ignore `seq_ids` (everything they need is in the batch's page tables). The linear
reference needs them, because its contiguous caches are keyed by request, not by page.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

from g4rt.models import manifest as mf
from g4rt.models.config import Gemma4Config
from g4rt.models.layout import PageGeometry
from g4rt.models.step import StepBatch


@dataclass
class Feed:
    """Token ids a step takes from the device instead of its batch: `token_ids[index] = tokens`.

    Step n+1 is scheduled before the host has seen step n's sampled ids; those tokens are
    placeholders in its batch, and `tokens` are step n's ids for them, still on the device."""

    index: torch.Tensor  # int64 [F]: flat token indices, on the engine's device
    tokens: torch.Tensor  # int64 [F], on the engine's device

    def apply(self, token_ids: torch.Tensor) -> None:
        token_ids.index_copy_(0, self.index, self.tokens.to(token_ids.dtype))


class EngineDead(RuntimeError):
    """The engine failed for good: every later step would fail too (module docstring)."""


class Engine(Protocol):
    geometry: PageGeometry
    config: Gemma4Config

    def step(self, batch: StepBatch, seq_ids: Sequence[int] = ()) -> torch.Tensor: ...

    def release(self, seq_id: int) -> None: ...


def open_engine(engine_dir: str | Path, num_frames: int, **kw) -> Engine:
    """Open any engine directory as an Engine, by its manifest's backend. Keyword arguments go to
    that backend's engine (`device` and `kernels` for inductor, `device` for tensorrt, `providers` and
    `threads` for onnxruntime)."""
    backend = mf.read_manifest(engine_dir).get("backend")
    if backend == "onnxruntime":
        from .onnxruntime import OrtEngine
        return OrtEngine(engine_dir, num_frames, **kw)
    if backend == "inductor":
        from .inductor import InductorEngine
        return InductorEngine.open(engine_dir, num_frames, **kw)
    if backend == "tensorrt":
        from .tensorrt import TrtEngine
        return TrtEngine(engine_dir, num_frames, **kw)
    raise mf.ManifestError(f"{engine_dir}: manifest field 'backend' is {backend!r}, expected one of "
                           f"{', '.join(mf.BACKENDS)}")
