"""Prefill and mixed steps as CUDA graphs: the token-wise work captured in segments between the
attention calls, per token-count bucket; the attention calls run eagerly between the segments.

Why: a step that is not a pure decode (a prefill chunk, or decodes mixed with one) has too many
shapes (tokens, sequences, table widths, logits rows) to capture whole, and run as plain torch it
pays the host's cost of every op of every layer, which each new request's mixed step would add to
every running decode's inter-token time (runtime/results/README.md and DESIGN.md have the times).
Everything in the model except the attention call is token-wise (each token's row is computed from
that row alone, MoE routing included), so that part depends only on the number of tokens: padded to
a bucket T' >= T (token 0 at position 0 in the padded rows) it can be replayed from a graph captured
once per bucket (`token_bucket`; the eager engines pad to the same rows, plugins/buckets.py says
why). The attention call (K/V write, paged attention) runs
eagerly on the real T rows with the step's real metadata (its kernels called as plain functions,
not through the dispatcher: models/paged.py `attention_into`), reading its q/k/v where the segment
before it wrote them and writing its output into the static buffer the segment after it reads.
This is vLLM's piecewise CUDA graph, over the model's own attention callback (models/paged.py).

Per bucket: L + 1 graphs (L attention calls), sharing the engine's graph memory pool; tokens and
positions as static inputs. A segment's q, k and v stay where it wrote them, in the graph pool: the
attention call reads them through aliases that do not own that memory (`_alias`), so later captures
may reuse it, which is safe because nothing runs between a segment's replay and its attention call
(copying them into static buffers would cost a device copy per layer per step;
export/results/README.md has its cost for the 31B). The attention output goes to a static o buffer
sized for the bucket and shared by its layers. A step's inputs go through one pinned host buffer
(two in turn, as the decode graphs' do, inductor.py) in two host-to-device copies.
The padded rows compute garbage that nothing reads: their attention output is whatever a previous
step left in the o buffer (finite), and the logits are taken at the real rows only.
"""
from __future__ import annotations

import math

import torch

from g4rt.models.step import StepBatch, input_shape, padding_batch
from g4rt.plugins.buckets import TOKEN_BUCKETS_UP_TO, token_bucket

META = StepBatch.names()[2:]  # the fields after token_ids and positions: the attention's and the rows


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The token buckets (plugins/buckets.py `token_bucket`) of steps of up to `max_tokens` tokens."""
    top = token_bucket(min(max_tokens, TOKEN_BUCKETS_UP_TO))
    return tuple(1 << i for i in range(top.bit_length()))


class _Memory:
    """`__cuda_array_interface__` of a CUDA tensor's memory, as integers of its element size: what
    `torch.as_tensor` builds a tensor over without taking a reference to the tensor's storage."""

    def __init__(self, x: torch.Tensor):
        size = x.element_size()
        self.__cuda_array_interface__ = {"shape": tuple(x.shape), "typestr": f"<i{size}", "version": 3,
                                         "data": (x.data_ptr(), False), "strides": tuple(size * s for s in x.stride())}


def _alias(x: torch.Tensor | None) -> torch.Tensor | None:
    """A view of `x`'s memory that does not keep it allocated (the captured segment's outputs: see the
    module docstring for why the pool may reuse it)."""
    return None if x is None else torch.as_tensor(_Memory(x), device=x.device).view(x.dtype)


ALIGN = 4  # int32 elements: 16 bytes, the pointer alignment Triton compiles a kernel variant for


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """One step's int32 inputs in a pinned host buffer: token ids and positions padded to the bucket,
    then the other fields, each at a 16-byte aligned offset. `stage` fills it and returns the metadata
    as device views.

    Why aligned: Triton compiles a variant of a kernel per pointer argument that is or is not 16-byte
    aligned; packed end to end, the fields' alignments changed with every batch's sizes, and each new
    combination compiled the attention kernels anew during serving (2-3 s stalls on the H200's 31B)."""

    def __init__(self, device):
        self.device = device
        self._host: list[torch.Tensor] = []
        self._meta = torch.empty(0, dtype=torch.int32, device=device)
        self._turn = 0

    @staticmethod
    def meta_size(sizes) -> int:
        """Elements the metadata of fields of `sizes` elements takes, aligned."""
        return sum(_aligned(n) for n in sizes)

    def reserve(self, tokens: int, meta: int) -> None:
        """Room for `tokens` padded tokens and `meta` metadata elements (grows, never shrinks)."""
        if not self._host or self._host[0].numel() < 2 * tokens + meta:
            pin = self.device.type == "cuda"
            self._host = [torch.empty(2 * tokens + meta, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        if self._meta.numel() < meta:
            self._meta = torch.empty(meta, dtype=torch.int32, device=self.device)

    def stage(self, batch: StepBatch, tokpos: torch.Tensor) -> list[torch.Tensor]:
        """Copy `batch`'s token ids and positions into `tokpos` (device, [2, T'], padded with zeros) and
        its other fields into the metadata buffer; return those as device views, in contract order."""
        tp, t = tokpos.shape[1], batch.num_tokens
        fields = [getattr(batch, name) for name in META]
        offsets, total = [], 0
        for f in fields:
            offsets.append(total)
            total += _aligned(f.numel())
        self.reserve(tp, total)
        host = self._host[self._turn]
        self._turn ^= 1
        head = host[: 2 * tp].view(2, tp)
        head[:, t:].zero_()
        head[0, :t] = batch.token_ids
        head[1, :t] = batch.positions
        region = host[2 * tp: 2 * tp + total]
        for f, o in zip(fields, offsets):
            region[o: o + f.numel()] = f.reshape(-1)
        tokpos.copy_(head, non_blocking=True)
        meta = self._meta[:total]
        meta.copy_(region, non_blocking=True)
        return [meta[o: o + f.numel()].view(f.shape) for f, o in zip(fields, offsets)]


class _Bucket:
    """A token bucket's captured segments and the static tensors they read and write."""

    def __init__(self, segments: list, layers: list, tokpos: torch.Tensor, hidden: torch.Tensor):
        self.segments, self.layers, self.tokpos, self.hidden = segments, layers, tokpos, hidden


class PiecewiseGraphs:
    """Steps of up to TOKEN_BUCKETS_UP_TO tokens replayed as segment graphs over `paged` (a PagedStep
    whose model runs its layers in pieces: eager or the inductor engine's compiled pieces) and `arena`,
    at the rows `paged` computes them at (`token_bucket`, PagedStep(pad_tokens=True))."""

    def __init__(self, paged, arena: torch.Tensor):
        self.paged, self.arena, self.device = paged, arena, arena.device
        cfg = paged.model.config
        # per token, the most elements any layer's attention output (the o buffer) holds
        self._row = cfg.num_attention_heads * max(cfg.head_dim, cfg.global_head_dim)
        self._buckets: dict[int, _Bucket] = {}
        self.staging = Staging(self.device)

    @staticmethod
    def covers(batch: StepBatch) -> bool:
        return batch.num_tokens <= TOKEN_BUCKETS_UP_TO

    def capture(self, tokens: int, pool):
        """Capture the bucket of `tokens` tokens (once); returns the graph memory pool to share."""
        tp = token_bucket(tokens)
        if tp in self._buckets:
            return pool
        dummy = padding_batch(tp, device=self.device).tensors()  # the capture's metadata
        model, dtype = self.paged.model, self.paged.model.dtype
        o_buf = torch.zeros(tp * self._row, dtype=dtype, device=self.device)
        tokpos = torch.zeros(2, tp, dtype=torch.int32, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile the pieces for this shape and warm up outside capture
                self.paged(self.arena, *dummy)
            attend = self.paged.attention_into(self.arena, *dummy[2:-1])
            segments, layers = [], []
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)

            def attention(layer, q, k, v):
                nonlocal graph
                graph.capture_end()
                segments.append(graph)
                q, k, v = _alias(q), _alias(k), _alias(v)  # the segment's outputs, where it writes them
                o = o_buf[: q.numel()].view(q.shape)
                attend(layer, q, k, v, o)  # eager, between the captures
                o.zero_()  # that call read memory no kernel had written yet: padded rows must start finite
                layers.append((layer, q, k, v, o))
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=segments[0].pool())
                return o

            hidden = model(tokpos[0], tokpos[1], attention)
            graph.capture_end()
            segments.append(graph)
            for g in segments:  # the first launch uploads a graph (InductorEngine.warmup says why)
                g.replay()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._buckets[tp] = _Bucket(segments, layers, tokpos, hidden)
        return segments[0].pool()

    def reserve(self, max_seqs: int, max_sliding_pages: int, max_full_pages: int) -> None:
        """Room in the staging buffers for the largest step within these bounds."""
        sizes = {"tokens": TOKEN_BUCKETS_UP_TO, "seqs": max_seqs, "rows": max_seqs,
                 "sliding_pages": max_sliding_pages, "full_pages": max_full_pages}
        self.staging.reserve(TOKEN_BUCKETS_UP_TO, Staging.meta_size(math.prod(input_shape(n, sizes)) for n in META))

    def step(self, batch: StepBatch, feed=None) -> torch.Tensor:
        """Logits of `batch` (its bucket captured already, `capture`); `feed` as in engines.Feed."""
        t = batch.num_tokens
        b = self._buckets[token_bucket(t)]
        meta = self.staging.stage(batch, b.tokpos)
        if feed is not None:
            feed.apply(b.tokpos[0, :t])
        attend = self.paged.attention_into(self.arena, *meta[:-1])
        for segment, (layer, q, k, v, o) in zip(b.segments, b.layers):
            segment.replay()
            attend(layer, q[:t], None if k is None else k[:t], None if v is None else v[:t], o[:t])
        b.segments[-1].replay()
        return self.paged.model.logits(b.hidden.index_select(0, meta[-1].long()))
