"""`ParallelEngine`: one model over `tp` devices of one host, one process per rank (tensor parallel).

Rank 0 lives in the caller's process and is the engine the runtime sees: the scheduler, sampler and
server run there, unchanged. Ranks 1..tp-1 are processes spawned with torch.multiprocessing; every
rank builds its own engine (`build_rank_engine`: the rank's shards of the weights, models/parallel.py,
and its own KV arena of the rank geometry, the same frames and page layout on every rank, so rank 0's
page tables are every rank's). Each step rank 0 sends a small header (op and sizes) down a pipe to
each worker and broadcasts the step's int32 tensors (the `StepBatch` fields, then the `Feed` that
supplies tokens still on the device) over the process group; then every rank calls its engine's
`step` with the same arguments, the model's all-reduces and the logits gather run inside it, and rank
0 returns the logits. NCCL on CUDA (the broadcast reads and writes device memory, so rank 0 never
waits for the device), gloo on CPU.

Why a pipe for the header: a worker waits for the next step as long as the server is idle, which a
collective cannot do without timing out. Every collective therefore starts only once all ranks are
about to join it, and `timeout_s` bounds each one. Failures: a rank that raises sends its traceback
to rank 0 and exits; rank 0 raises an error naming it (gloo notices the dead peer at once;
NCCL at the collective timeout) and stops the other ranks. A failure while loading is reported the
same way before any collective runs, within `init_timeout_s`. A failure during a step or a call stops
every rank, so the engine is dead from then on: that failure and every later step raise
`ParallelEngineDead` (an `EngineDead`, engines/__init__.py), which the service treats as fatal.
"""
from __future__ import annotations

import datetime
import math
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from g4rt.models.config import load_config
from g4rt.models.layout import PAGE_TOKENS, KVLayout, PageGeometry, torch_dtype
from g4rt.models.parallel import ParallelError, check_tensor_parallel, load_rank_model, random_rank_model, \
    rank_config
from g4rt.models.step import StepBatch, input_shape, to_device

from ..arena import Arena
from . import EngineDead, Feed
from .eager import EagerEngine

BACKENDS = ("eager", "inductor")
_SIZES = ("tokens", "seqs", "sliding_pages", "full_pages", "rows", "feed")


class ParallelEngineDead(ParallelError, EngineDead):
    """A rank failed and every rank was stopped: this engine runs no further step."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds; pickled to the spawned ranks. `model` is a checkpoint directory, or,
    with `random_seed`, a config (directory or published name) whose weights are
    `checkpoint.random_model(..., seed=random_seed, init=init)` sliced per rank."""

    model: str
    tensor_parallel: int
    num_frames: int
    dtype: str | None = None  # default: the config's (random weights: bfloat16)
    device: str = "cpu"  # "cpu", or "cuda[:k]": rank r on cuda:(k + r)
    kernels: str | None = None
    page_tokens: int = PAGE_TOKENS
    backend: str = "eager"  # "eager" | "inductor" (torch.compile per rank, decode as CUDA graphs)
    compile_mode: str | None = "default"
    compile_scope: str = "layers"
    random_seed: int | None = None
    init: str = "default"
    cpu_threads: int | None = None  # torch threads of each CPU rank (rank 0's is the caller's process)
    init_timeout_s: float = 600.0  # every rank loaded and joined the process group
    timeout_s: float = 600.0  # one collective

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ParallelError(f"backend: {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.num_frames <= 0:
            raise ParallelError(f"num_frames must be positive, got {self.num_frames}")
        if min(self.init_timeout_s, self.timeout_s) <= 0:
            raise ParallelError("init_timeout_s and timeout_s must be positive")

    def threads_per_rank(self) -> int:
        """CPU ranks share the cores: each gets its share of this process's cores, since more threads
        than cores make OpenMP spin against the other ranks."""
        return self.cpu_threads or max(1, len(os.sched_getaffinity(0)) // self.tensor_parallel)

    def config(self):
        return load_config(self.model)

    def weights_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype or ("bfloat16" if self.random_seed is not None else self.config().dtype))

    def rank_device(self, rank: int) -> torch.device:
        d = torch.device(self.device)
        return torch.device("cuda", (d.index or 0) + rank) if d.type == "cuda" else d

    def geometry(self) -> PageGeometry:
        """Every rank's page geometry (the rank config's), known before any rank is built."""
        cfg = self.config()
        check_tensor_parallel(cfg, self.tensor_parallel)
        layout = KVLayout.from_config(rank_config(cfg, self.tensor_parallel), self.weights_dtype())
        return PageGeometry.build(layout, self.page_tokens)


def build_rank_engine(spec: RankSpec, rank: int):
    """Rank `rank`'s engine: its model shards on its device, over its own arena."""
    device = spec.rank_device(rank)
    tp = spec.tensor_parallel
    if spec.random_seed is None:
        model = load_rank_model(spec.model, tp, rank, spec.dtype, device, spec.kernels)
    else:
        model = random_rank_model(spec.config(), tp, rank, spec.weights_dtype(), device, spec.random_seed,
                                  spec.kernels, spec.init)
    return engine_for(spec, model)


def engine_for(spec: RankSpec, model):
    """`spec.backend`'s engine over `model` (on its device), with an arena of `spec.num_frames` frames of
    the model's geometry."""
    geometry = PageGeometry.build(model.layout, spec.page_tokens)
    if spec.backend == "inductor":
        from .inductor import InductorEngine
        return InductorEngine(model, geometry, spec.num_frames, spec.compile_mode, spec.compile_scope)
    return EagerEngine(model, geometry, Arena.for_geometry(geometry, spec.num_frames, next(model.parameters()).device))


def _join_group(spec: RankSpec, rank: int, store: dist.Store) -> torch.device:
    """Join the process group; returns the device the step broadcast lives on."""
    device = spec.rank_device(rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.tensor_parallel,
                            timeout=datetime.timedelta(seconds=spec.timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return device


def _payload_shapes(sizes: dict[str, int]) -> list[tuple[int, ...]]:
    shapes = [input_shape(name, sizes) for name in StepBatch.names()]
    return shapes + [(sizes["feed"],), (sizes["feed"],)]  # feed index, feed tokens


def _unpack(payload: torch.Tensor, sizes: dict[str, int]) -> tuple[StepBatch, Feed | None]:
    """A worker's step from the broadcast: the batch on the host (as rank 0 holds it), the feed on the device."""
    shapes = _payload_shapes(sizes)
    n = [math.prod(s) for s in shapes]
    split = sum(n[:-2])
    host = payload[:split].cpu()
    batch = StepBatch(*(v.view(s) for v, s in zip(host.split(n[:-2]), shapes[:-2])))
    f = sizes["feed"]
    feed = Feed(payload[split:split + f].long(), payload[split + f:].long()) if f else None
    return batch, feed


def _worker(rank: int, spec: RankSpec, build: Callable, store_port: int, conn) -> None:
    """A rank other than 0: build, report, join the group, then run what rank 0 sends until "stop".
    Ctrl-C reaches every process of the terminal's group; rank 0 decides when the ranks stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = spec.rank_device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.threads_per_rank())
        engine = build(spec, rank)
        conn.send(("loaded", None))
        store = dist.TCPStore("127.0.0.1", store_port, spec.tensor_parallel, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.init_timeout_s))
        comm = _join_group(spec, rank, store)
        with torch.inference_mode():
            while True:
                try:
                    op, args = conn.recv()
                except EOFError:  # rank 0 is gone
                    break
                if op == "stop":
                    break
                if op == "step":
                    sizes = dict(zip(_SIZES, args))
                    payload = torch.empty(sum(math.prod(s) for s in _payload_shapes(sizes)), dtype=torch.int32,
                                          device=comm)
                    dist.broadcast(payload, 0)
                    batch, feed = _unpack(payload, sizes)
                    engine.step(batch, (), feed)
                elif op == "call":
                    name, a, kw = args
                    if hasattr(engine, name):
                        getattr(engine, name)(*a, **kw)
        dist.destroy_process_group()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            raise SystemExit(1)


class ParallelEngine:
    """The Engine protocol over `spec.tensor_parallel` ranks (module docstring). `build(spec, rank)`
    makes each rank's engine (default `build_rank_engine`; it must be importable by a spawned process).
    Close it (`close()` or `with`) to stop the ranks."""

    takes_feed = True

    def __init__(self, spec: RankSpec, build: Callable = build_rank_engine):
        tp = spec.tensor_parallel
        self.config = spec.config()
        check_tensor_parallel(self.config, tp)
        if dist.is_initialized():
            raise ParallelError("this process already has a default process group; a ParallelEngine makes its own")
        self.spec, self.tp = spec, tp
        self._error: str | None = None
        self._conns, self._procs = [], []
        self._comm = spec.rank_device(0)
        deadline = time.monotonic() + spec.init_timeout_s
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=spec.init_timeout_s))
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, tp):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=_worker, args=(rank, spec, build, store.port, theirs), daemon=True,
                                name=f"g4rt-tp-rank{rank}")
                p.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(p)
            if self._comm.type == "cuda":
                torch.cuda.set_device(self._comm)
            else:
                torch.set_num_threads(spec.threads_per_rank())
            self.inner = build(spec, 0)
            self._await_loaded(deadline)
            _join_group(spec, 0, store)
        except BaseException:
            self.close(timeout_s=1.0)  # ranks still loading or joining do not read "stop"
            raise
        self.geometry = self.inner.geometry
        self.device = getattr(self.inner, "device", self._comm)

    def _await_loaded(self, deadline: float) -> None:
        """Wait until every worker has built its engine; raise the first failure, or a timeout."""
        waiting = dict(enumerate(self._conns, start=1))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ParallelError(f"tensor-parallel rank(s) {sorted(waiting)} did not load within "
                                    f"{self.spec.init_timeout_s} s (init_timeout_s)")
            sentinels = {self._procs[r - 1].sentinel: r for r in waiting}
            for ready in wait(list(waiting.values()) + list(sentinels), timeout=left):
                rank = sentinels.get(ready) or next(r for r, c in waiting.items() if c is ready)
                conn = waiting.pop(rank, None)
                if conn is None:
                    continue
                if conn.poll():
                    kind, detail = conn.recv()
                    if kind == "loaded":
                        continue
                    raise ParallelError(f"tensor-parallel rank {rank} failed while loading:\n{detail}")
                raise ParallelError(f"tensor-parallel rank {rank} exited (code {self._procs[rank - 1].exitcode}) "
                                    f"while loading")

    # ---- what rank 0 tells the others ------------------------------------------------------------
    def _send(self, message) -> None:
        for conn in self._conns:
            conn.send(message)

    def _failure(self, error: BaseException) -> None:
        """Stop every rank after `error`; `_error` says why: a worker's own report when one came."""
        reports = []
        for conn in wait(self._conns, timeout=0.5) if self._conns else []:
            try:
                kind, detail = conn.recv()
            except (EOFError, OSError):
                continue
            if kind == "error":
                reports.append((self._conns.index(conn) + 1, detail))
        self.close(timeout_s=1.0)  # a rank still inside a collective will not read "stop"
        if reports:
            rank, detail = reports[0]
            self._error = f"tensor-parallel rank {rank} failed:\n{detail}"
        else:
            self._error = f"tensor-parallel rank 0 failed: {type(error).__name__}: {error}"

    def _raise(self, error: BaseException):
        """Stop every rank and raise: `ParallelEngineDead` naming the failed rank, from `error` (an
        interrupt, not an Exception, is raised as it is; the engine is dead all the same)."""
        self._failure(error)
        if not isinstance(error, Exception):
            raise error
        raise ParallelEngineDead(self._error) from error

    def _guard(self) -> None:
        if self._error is not None:
            raise ParallelEngineDead(f"the tensor-parallel engine stopped after an error; {self._error}")
        if self._procs is None:
            raise ParallelEngineDead("the tensor-parallel engine is closed")

    def _pack(self, batch: StepBatch, feed: Feed | None) -> torch.Tensor:
        flat = to_device(torch.cat([t.reshape(-1) for t in batch.tensors()]), self._comm)
        if feed is None:
            return flat
        return torch.cat([flat, feed.index.to(self._comm, torch.int32), feed.tokens.to(self._comm, torch.int32)])

    def _call(self, name: str, *args, **kwargs):
        """Run `inner.name(*args, **kwargs)` on every rank (e.g. CUDA-graph captures, which hold collectives)."""
        self._guard()
        try:
            self._send(("call", (name, args, kwargs)))
            return getattr(self.inner, name)(*args, **kwargs) if hasattr(self.inner, name) else None
        except BaseException as e:
            self._raise(e)

    # ---- Engine protocol -------------------------------------------------------------------------
    def step(self, batch: StepBatch, seq_ids: Sequence[int] = (), feed: Feed | None = None) -> torch.Tensor:
        self._guard()
        try:
            sizes = (batch.num_tokens, batch.num_seqs, batch.sliding_table.shape[1], batch.full_table.shape[1],
                     int(batch.logits_rows.shape[0]), 0 if feed is None else int(feed.index.shape[0]))
            self._send(("step", sizes))
            dist.broadcast(self._pack(batch, feed), 0)
            return self.inner.step(batch, seq_ids, feed)
        except BaseException as e:
            self._raise(e)

    def plan_batches(self, max_batch: int) -> None:
        self._call("plan_batches", max_batch)

    def warmup(self, **bounds) -> int:
        return self._call("warmup", **bounds) or 0

    def release(self, seq_id: int) -> None:
        """Nothing to send: paged engines keep no per-request state (the runtime owns the pages)."""
        self.inner.release(seq_id)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (asked first, then terminated after `timeout_s`) and leave the process group."""
        if self._procs is None:
            return
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        end = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = None, []
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> "ParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
