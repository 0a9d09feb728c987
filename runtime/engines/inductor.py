"""Inductor backend: torch.compile of PagedStep with the arena held by the module, and decode steps
replayed as CUDA graphs per batch-size bucket.

Why not AOTInductor: its packages crashed at load on the H200 image (trt-onnx.md §6.3). Why the arena
is a module buffer: CUDA-graph capture skips graphs whose inputs are mutated (§6.2); a buffer the
module owns is not an input. The engine directory holds only a manifest (weights reference and
settings) plus the compiler caches, so a restart reuses compiled kernels.

Decode graphs: a decode step has one token per sequence (T == B == R). Its batch is padded on the
host to the next bucket size B' >= B (and a page-table width bucket) with dummy sequences (one token at
position 0, slots -1, so it writes nothing and reads frame 0), copied to the graph's static inputs in
one transfer, and the captured graph is replayed; the logits of the real rows are returned. Buckets go
up to the largest batch the scheduler admits (`plan_batches`, called by the runtime with its
max_num_seqs). Other steps (prefill chunks, mixed steps) of up to TOKEN_BUCKETS_UP_TO tokens replay
piecewise graphs per token bucket (piecewise.py); larger ones run the compiled module directly.

The runtime schedules a step while the previous one is still on the device (runtime/llm.py), so the
host side of a step must not wait for the device: each bucket has two pinned host buffers used in
turn (one may still be feeding the in-flight step's copy), tokens the host has not seen yet come in
as a `Feed` written on the device after the copy, and the returned logits are a view of the shared
logits buffer, valid until the next step (the sampler reads them in stream order before it).
The capture runs on CUDA only (bench/engine.py); the CPU suite checks the padding
(tests/test_engine_inductor.py).
"""
from __future__ import annotations

import copy
import logging
import math
import os
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from g4rt.models import manifest as mf
from g4rt.models.checkpoint import load_model
from g4rt.models.paged import PagedStep
from g4rt.models.step import StepBatch, input_shape, padding_batch
from g4rt.plugins.buckets import pow2_bucket

from ..arena import Arena
from .piecewise import PiecewiseGraphs, token_buckets

MAX_BATCH = 256  # decode graphs are captured up to this many sequences unless the runtime plans more

log = logging.getLogger(__name__)

# The compiler caches an engine directory keeps (its manifest's "compile_cache"): variable -> subdirectory.
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def use_compile_cache(engine_dir: str | Path, manifest: dict) -> dict[str, str]:
    """Point Inductor's and Triton's caches at `engine_dir`'s compile cache, so a restart reuses the
    kernels compiled before; returns {variable: directory in use}.

    They are environment variables, so the choice is per process, not per engine: Inductor reads
    TORCHINDUCTOR_CACHE_DIR whenever it opens its cache (torch._inductor.config has no setting for it),
    and its compile workers and the tensor-parallel ranks are processes of their own, which inherit the
    environment but not a `triton.knobs` setting made here. Call it before anything compiles, in the
    process that starts those. A variable already set is kept: the user's (a cache shared between
    directories) or an earlier engine's in this process; it is logged when it is not this directory's."""
    cache = mf.resolve_file(engine_dir, manifest, "compile_cache")
    used = {}
    for var, sub in CACHE_VARIABLES.items():
        want = str(cache / sub)
        used[var] = os.environ.setdefault(var, want)
        if used[var] != want:
            log.info("%s is set to %s: %s compiles into that, not into %s", var, used[var], engine_dir, want)
    return used


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """pow2_bucket's values up to the bucket of `max_batch`: the decode graphs' batch sizes."""
    return tuple(1 << i for i in range(pow2_bucket(max_batch).bit_length()))


class DecodeInputs:
    """A decode step's inputs padded to a bucket: `b` sequences, table widths `ms` / `mf`, as views (in
    StepBatch order) of one flat int32 buffer. Padded rows are a dummy sequence: token 0 at position 0,
    kv_len 1, slots -1 (it writes nothing), tables 0 (it reads frame 0), logits row = its own row."""

    def __init__(self, b: int, ms: int, mf_: int, device="cpu", pin: bool = False):
        sizes_of = {"tokens": b, "seqs": b, "rows": b, "sliding_pages": ms, "full_pages": mf_}
        shapes = {name: input_shape(name, sizes_of) for name in StepBatch.names()}
        sizes = [math.prod(s) for s in shapes.values()]
        self.flat = torch.empty(sum(sizes), dtype=torch.int32, device=device, pin_memory=pin)
        self.views = [v.view(shape) for v, shape in zip(self.flat.split(sizes), shapes.values())]
        self.fields = dict(zip(shapes, self.views))
        # Every row a dummy one (padding_batch), built once: `fill` copies it in one op, then the real rows.
        self._padding = torch.cat([t.reshape(-1) for t in padding_batch(b, ms, mf_).tensors()])

    def fill(self, batch: StepBatch | None) -> None:
        """Write `batch` (n <= b sequences of one token each; None: no sequence) and pad the rest."""
        self.flat.copy_(self._padding)
        if batch is not None:
            for dst, src in zip(self.views, batch.tensors()):
                dst = dst[:, : src.shape[1]] if src.dim() == 2 else dst
                dst[: src.shape[0]] = src


class ArenaStep(torch.nn.Module):
    """PagedStep (in-place KV writes) with the arena as a buffer, so CUDA graphs can be captured."""

    def __init__(self, paged, arena: torch.Tensor):
        super().__init__()
        self.paged = paged
        self.register_buffer("arena", arena, persistent=False)

    def forward(self, *batch: torch.Tensor, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        return self.paged(self.arena, *batch, logits_out=logits_out)


# Row counts Dynamo compiles a piece apart for, with dynamic shapes: one row (it specialises sizes of 1) and more.
ROW_CLASSES = 2


def layer_kinds(model) -> int:
    """How many decoder layers differ in what a compiled piece sees: their parameters' names and shapes (a
    KV-shared layer has no k/v projections or norms; sliding and full layers differ in head dims), and
    whether a layer before hands it a pending residual step (the first layer's has none)."""
    return len({(i == 0, tuple((name, tuple(p.shape)) for name, p in layer.named_parameters()))
                for i, layer in enumerate(model.layers)})


def _with_compiled_layers(model, mode: str):
    """A shallow copy of `model` whose decoder layers run compiled, weights shared with `model` (whose
    own layers stay eager: a benchmark compares the two on one set of weights).

    Compiled are the layer's two pieces around the attention call (`DecoderLayer.attention_inputs`,
    `after_attention`), not the layer: the attention call reads the layer index for its cache offsets,
    which would make Dynamo specialise, and recompile, per layer (past its recompile limit it falls
    back to eager). The pieces read no index, so each compiles once per layer kind (`layer_kinds`) and row
    class. Dynamo's cache is per code object, shared by every layer, and its default limit of 8 is fewer
    than the E4B's and E2B's 5 kinds x 2 classes: the limit is raised to what the model needs, never lowered."""
    limit = ROW_CLASSES * layer_kinds(model)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    view = copy.copy(model)
    view._modules = dict(model._modules)
    layers = []
    for layer in model.layers:
        twin = copy.copy(layer)  # own attribute dict, same parameter and submodule dicts
        twin.attention_inputs = torch.compile(twin.attention_inputs, mode=mode, dynamic=True)  # bound to twin
        twin.after_attention = torch.compile(twin.after_attention, mode=mode, dynamic=True)
        layers.append(twin)
    view._modules["layers"] = torch.nn.ModuleList(layers)
    return view


class InductorEngine:
    """PagedStep compiled by Inductor over an arena it owns; decode steps replayed as CUDA graphs.

    `InductorEngine.open(engine_dir, num_frames)` loads what a built engine directory names;
    the constructor takes a model already in memory (benchmarks build random weights on the GPU).
    `compile_mode=None` skips torch.compile and captures the eager step instead (a fallback for
    images where Inductor misbehaves; decode still replays as CUDA graphs).

    `compile_scope`: "layers" compiles the two pieces of each decoder layer around its attention call
    (layers of one shape share one compiled graph per piece, so compile time does not grow with depth;
    the model itself is left uncompiled: the engine works on a copy of its module tree that shares the
    weights); "step" compiles the whole step as one graph (fusion across layer boundaries, but Dynamo
    traces every layer, so its compile time grows with depth: export/results/README.md has the 31B's).
    Both scopes are checked against eager in tests/test_engine_inductor.py.
    """

    def __init__(self, model, geometry, num_frames: int, compile_mode: str | None = "default",
                 compile_scope: str = "layers", piecewise: bool = True):
        if compile_scope not in ("layers", "step"):
            raise ValueError(f"compile_scope must be 'layers' or 'step', got {compile_scope!r}")
        self.geometry = geometry
        self.config = model.config
        self.arena = Arena.for_geometry(geometry, num_frames, next(model.parameters()).device)
        self.device = self.arena.device
        self.compile_mode, self.compile_scope = compile_mode, compile_scope
        if compile_mode:
            # Round intermediates to the model dtype where eager torch does. Without it Inductor keeps
            # fused bf16 chains in fp32 and compiled logits drift further from eager ones. Fused
            # reductions still sum in another order, so compiled and eager bf16 are close, not
            # bit-equal (tests/test_engine_inductor.py).
            import torch._inductor.config as inductor_config
            inductor_config.emulate_precision_casts = True
        whole_step = bool(compile_mode) and compile_scope == "step"  # one graph, attention calls inside it
        step_model = _with_compiled_layers(model, compile_mode) if compile_mode and not whole_step else model
        # Padded token rows as the graphs replay them, except in the one graph of the "step" scope.
        self.module = ArenaStep(PagedStep(step_model, geometry, pad_tokens=not whole_step), self.arena.tensor)
        self.compiled = torch.compile(self.module, mode=compile_mode, dynamic=True) if whole_step else self.module
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, list[DecodeInputs], DecodeInputs]] = {}
        self._pool = None
        self._logits: torch.Tensor | None = None  # [largest bucket, vocab] fp32, every graph's output
        self._turn = 0  # which of a bucket's two host buffers the next decode step fills
        self._rows = 0  # rows the logits buffer gets at the first capture: the widest bucket planned
        self.plan_batches(MAX_BATCH)
        # Other steps of up to TOKEN_BUCKETS_UP_TO tokens replay segment graphs (piecewise.py).
        self.piecewise = (PiecewiseGraphs(self.module.paged, self.arena.tensor)
                          if piecewise and self.device.type == "cuda" and not whole_step else None)

    takes_feed = True

    def plan_batches(self, max_batch: int) -> None:
        """Capture decode graphs for batches up to `max_batch` (the scheduler's max_num_seqs)."""
        buckets = batch_buckets(max_batch)
        if self._logits is not None and buckets[-1] > self._logits.shape[0]:
            raise ValueError(f"decode graphs share a logits buffer of {self._logits.shape[0]} rows, captured "
                             f"already; plan_batches({max_batch}) must come before the first decode step")
        self.buckets = buckets
        self._rows = max(self._rows, buckets[-1])

    def warmup(self, max_seqs: int, max_sliding_pages: int, max_full_pages: int, max_tokens: int = 0) -> int:
        """Capture every graph a scheduler within these bounds can ask for, so that no request waits for
        a capture (`g4rt serve` calls this before it reports ready): the decode graphs and, for steps of
        up to `max_tokens` tokens, the piecewise token buckets; returns how many of both.

        A batch's sliding-table width comes from some request whose full table is at most the batch's
        full width, so only sliding buckets up to ceil(full bucket x full page / sliding page) occur.

        Each graph is launched once when captured (on its dummy inputs): the first launch of a CUDA graph
        also uploads it to the device, host time a later launch does not pay, which the first request to
        use a graph would otherwise pay; the warm-up pays it instead, once per graph (`bench.engine
        --first-launches` measures it; export/results/README.md has the numbers).

        Compiling and capturing them takes minutes for the large models (runtime/results/README.md), so
        each kind shows a progress bar on stderr."""
        if self.device.type != "cuda":
            return 0
        pt_s, pt_f = self.geometry.page_tokens["sliding"], self.geometry.page_tokens["full"]

        def upto(n: int) -> list[int]:
            return sorted({pow2_bucket(i) for i in range(1, max(1, n) + 1)})
        keys = [(b, s, f) for b in upto(min(max_seqs, self.buckets[-1])) for f in upto(max_full_pages)
                for s in upto(min(max_sliding_pages, -(-f * pt_f // pt_s)))]
        for key in tqdm(keys, desc="decode graphs", unit="graph", mininterval=2):
            self._graph_for(key)
        tokens = ()
        if self.piecewise is not None and max_tokens:
            self.piecewise.reserve(max_seqs, max_sliding_pages, max_full_pages)
            tokens = token_buckets(max_tokens)
            for t in tqdm(tokens, desc="piecewise token buckets", unit="bucket"):
                self._pool = self.piecewise.capture(t, self._pool)
        return len(keys) + len(tokens)

    @classmethod
    def open(cls, engine_dir: str | Path, num_frames: int, device: str = "cuda",
             kernels: str | None = None) -> "InductorEngine":
        """Load the weights inside `engine_dir` (`g4rt build` put them there) onto `device` and compile,
        with the compiler caches in the directory too (`use_compile_cache`), so a restart reuses compiled
        kernels."""
        engine_dir = Path(engine_dir)
        manifest = mf.check_manifest(engine_dir, backend="inductor")
        use_compile_cache(engine_dir, manifest)
        model = load_model(mf.resolve_file(engine_dir, manifest, "weights"), dtype=manifest["dtype"], device=device,
                           kernels=kernels, kv_dtype=mf.manifest_kv_dtype(manifest))
        mf.check_manifest(engine_dir, config=model.config)
        return cls(model, mf.manifest_geometry(manifest), num_frames, manifest["compile"]["mode"],
                   manifest["compile"].get("scope", "layers"))

    # ---- decode graphs -------------------------------------------------------------------------
    def _graph_for(self, key):
        """The decode graph of bucket `key`, captured on first use. Its inputs are views of one device
        buffer that a pinned host twin fills (one copy per step); it writes its logits into one buffer
        shared by every graph (the softcap's launch writes them there), so more buckets cost no more than
        their intermediates."""
        if key not in self._graphs:
            b = key[0]
            hosts = [DecodeInputs(*key, pin=True) for _ in range(2)]
            hosts[0].fill(None)  # a dummy batch (every row a padded one) for warm-up and capture
            device = DecodeInputs(*key, device=self.device)
            device.flat.copy_(hosts[0].flat)
            if self._logits is None:
                self._logits = torch.empty(self._rows, self.config.vocab_size, dtype=torch.float32,
                                           device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile + warm up outside capture, called as captured
                    self.compiled(*device.views, logits_out=self._logits[:b])
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.compiled(*device.views, logits_out=self._logits[:b])
            self._pool = graph.pool()
            graph.replay()  # on the dummy batch: the first launch uploads the graph (warmup says why)
            self._graphs[key] = (graph, hosts, device)
        return self._graphs[key]

    def _decode(self, batch: StepBatch, feed) -> torch.Tensor:
        n = batch.num_seqs
        key = tuple(pow2_bucket(w) for w in (n, batch.sliding_table.shape[1], batch.full_table.shape[1]))
        graph, hosts, device = self._graph_for(key)
        # Two host buffers in turn: the runtime has waited for the sampled ids of the step before the
        # previous one, so the buffer that step's copy read is free; the other may still be in use.
        host = hosts[self._turn]
        self._turn ^= 1
        host.fill(batch)
        device.flat.copy_(host.flat, non_blocking=True)
        if feed is not None:
            feed.apply(device.fields["token_ids"])
        graph.replay()
        return self._logits[:n]

    # ---- Engine protocol -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, batch: StepBatch, seq_ids: Sequence[int] = (), feed=None) -> torch.Tensor:
        """Logits of `batch` (a view valid until the next step); `feed` as in runtime.engines.Feed."""
        if batch.is_decode and batch.num_seqs <= self.buckets[-1] and self.device.type == "cuda":
            return self._decode(batch, feed)
        if self.piecewise is not None and self.piecewise.covers(batch):
            self._pool = self.piecewise.capture(batch.num_tokens, self._pool)  # captured on first use
            return self.piecewise.step(batch, feed)
        batch = batch.to(self.device)  # not waiting for the step in flight
        if feed is not None:
            feed.apply(batch.token_ids)
        return self.compiled(*batch.tensors())

    def release(self, seq_id: int) -> None:
        """Nothing to do: the runtime owns the pages."""
