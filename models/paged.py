"""The step graph: the model over the paged KV arena, one varlen step per call.

`PagedStep.forward(arena, *StepBatch.tensors())` runs the model on the step's flat token axis. Each
cache-owning layer scatters its new K/V rows into the arena and attends (`StepAttention`: `g4rt::kv_write_attention_`,
or when exporting the functional `g4rt::kv_write` and then `g4rt::paged_attention`, the ONNX graph's two plugins);
a KV-shared layer only attends, using its source layer's K/V offsets (`PageGeometry.layer_offsets`). Sliding layers
use the sliding page table / first page / slots, full layers the full ones with first page 0. With the Triton
kernels a layer with packed q/k/v hands over its projection before the norms and RoPE (`ProjectedAttention`), and
a decode step's norms, KV write and attention are one launch.

The graph has no host syncs and no data-dependent Python control flow (what depends on the data runs
inside opaque ops: attention, the KV write, the MoE experts, and with the Triton kernels the elementwise
blocks and projections of models/blocks.py), so it is what torch.compile, torch.export and the ONNX
exporter trace. Layer
constants (offsets, page size, head counts, window) and the model's `kernels` choice are constants baked
into the graph.
"""
from __future__ import annotations

import torch
from torch import nn

from g4rt.plugins.ops import implementations  # importing it registers torch.ops.g4rt.*
from g4rt.plugins.buckets import token_bucket
from g4rt.plugins.reference import window_left

from .layout import LayerKV, PageGeometry
from .model import Gemma4Model, attend


class PagedStep(nn.Module):
    """`forward(arena, token_ids, positions, cu_q, kv_lens, sliding_table, sliding_first, sliding_slots,
    full_table, full_slots, logits_rows)` -> fp32 logits [R, vocab]; with `functional=True` it returns
    `(logits, new_arena)` and never mutates its input (ONNX export).

    With `pad_tokens` (the eager and inductor engines) the model runs on `token_bucket(T)` rows: the
    token ids and positions padded with token 0 at position 0, the attention calls on the real T rows
    (`padded_forward`). Everything else is row-wise, so the padding changes no row but the matmuls' row
    count, which it makes the same as the CUDA-graph replays' (plugins/buckets.py says why)."""

    def __init__(self, model: Gemma4Model, geometry: PageGeometry, functional: bool = False,
                 pad_tokens: bool = False):
        super().__init__()
        if geometry.layout.config != model.config:
            raise ValueError("PagedStep: the page geometry was built for a different config than the model")
        self.model = model
        self.geometry = geometry
        self.functional = functional
        self.pad_tokens = pad_tokens

    def _groups(self, kv_lens, sliding_table, sliding_first, sliding_slots, full_table, full_slots) -> dict:
        """Per layer kind (sliding or not): its page table, first logical pages, slots and page tokens."""
        full_first = torch.zeros_like(kv_lens)  # the full group always starts at logical page 0
        page = self.geometry.page_tokens
        return {True: (sliding_table, sliding_first, sliding_slots, page["sliding"]),
                False: (full_table, full_first, full_slots, page["full"])}

    def attention_over(self, arena, cu_q, kv_lens, sliding_table, sliding_first, sliding_slots, full_table,
                       full_slots) -> "StepAttention":
        """The model's attention callable over `arena` for one step's metadata; its `arena` is the arena after its
        writes (a new tensor when functional). With the Triton kernels, in place, it also takes a packed layer's
        projection (`ProjectedAttention`)."""
        groups = self._groups(kv_lens, sliding_table, sliding_first, sliding_slots, full_table, full_slots)
        if self.functional or self.model.kernels != "triton":
            return StepAttention(self, arena, cu_q, kv_lens, groups)
        from g4rt.plugins import triton_kv_write  # noqa: F401  (registers g4rt::projected_attention_)
        return ProjectedAttention(self, arena, cu_q, kv_lens, groups)

    def attention_into(self, arena, cu_q, kv_lens, sliding_table, sliding_first, sliding_slots, full_table,
                       full_slots):
        """`attention_over`'s callback as `attend(layer, q, k, v, out)`, writing its output into `out`, for
        an eager caller outside any tracing (the piecewise graphs between their captured segments,
        runtime/engines/piecewise.py): the same kernels, called as plain functions
        (plugins.ops.implementations) instead of through the dispatcher, twice per layer per step.
        In place only: the functional arena is export's."""
        if self.functional:
            raise ValueError("attention_into writes the arena in place; this PagedStep is functional")
        geo = self.geometry
        groups = self._groups(kv_lens, sliding_table, sliding_first, sliding_slots, full_table, full_slots)
        write, attend = implementations(self.model.kernels)

        def attention(layer: LayerKV, q, k, v, out):
            table, first, slots, page = groups[layer.sliding]
            k_off, v_off = geo.layer_offsets(layer.index)
            if k is not None:
                write(arena, k, v, slots, k_off, v_off, page)
            return attend(q, arena, cu_q, kv_lens, table, first, k_off, v_off, page, layer.num_kv_heads,
                          window_left(layer.window), 1.0, out=out)
        return attention

    def forward(self, arena, token_ids, positions, cu_q, kv_lens, sliding_table, sliding_first, sliding_slots,
                full_table, full_slots, logits_rows, logits_out=None):
        """`logits_out`: a buffer of the logits' shape the logits are written into (`Gemma4Model.logits`)."""
        attention = self.attention_over(arena, cu_q, kv_lens, sliding_table, sliding_first, sliding_slots,
                                        full_table, full_slots)
        hidden = (padded_forward(self.model, token_ids, positions, attention) if self.pad_tokens
                  else self.model(token_ids, positions, attention))
        logits = self.model.logits(hidden.index_select(0, logits_rows.long()), logits_out)
        return (logits, attention.arena) if self.functional else logits


class StepAttention:
    """`PagedStep.attention_over`'s callable: a layer's KV write and attention over one step's arena and metadata.
    A cache-owning layer writes and attends in one op, `g4rt::kv_write_attention_` (its Triton kernels write a
    decode step's rows in the attention launch); exporting, the functional `g4rt::kv_write` and then
    `g4rt::paged_attention`, the ONNX graph's two plugins, each write making `arena` a new tensor."""

    def __init__(self, step: PagedStep, arena, cu_q, kv_lens, groups: dict):
        self.step, self.arena, self.cu_q, self.kv_lens, self.groups = step, arena, cu_q, kv_lens, groups

    def where(self, layer: LayerKV):
        """The layer's (page table, first pages, slots, page tokens) and (k_offset, v_offset)."""
        return self.groups[layer.sliding], self.step.geometry.layer_offsets(layer.index)

    def __call__(self, layer: LayerKV, q, k, v):
        (table, first, slots, page), (k_off, v_off) = self.where(layer)
        kernels = self.step.model.kernels
        rest = (k_off, v_off, page, layer.num_kv_heads, window_left(layer.window), 1.0, kernels)
        if k is not None and not self.step.functional:
            return torch.ops.g4rt.kv_write_attention_(self.arena, k, v, slots, q, self.cu_q, self.kv_lens, table,
                                                      first, *rest)
        if k is not None:
            self.arena = torch.ops.g4rt.kv_write(self.arena, k, v, slots, k_off, v_off, page, kernels)
        return torch.ops.g4rt.paged_attention(q, self.arena, self.cu_q, self.kv_lens, table, first, *rest)


class ProjectedAttention(StepAttention):
    """StepAttention with the Triton kernels, in place: a packed layer hands it its projection before the norms and
    RoPE (models.model.attend), and `g4rt::projected_attention_` norms, ropes, writes and attends a decode cut over
    its keys in one launch (the q/k/v norm kernel and kv_write_attention_ otherwise)."""

    def from_projection(self, attn, y, cos, sin):
        layer = attn.kv
        (table, first, slots, page), (k_off, v_off) = self.where(layer)
        return torch.ops.g4rt.projected_attention_(
            self.arena, y, attn.q_norm.weight, attn.k_norm.weight if layer.owns_cache else None, attn.q_norm.eps,
            cos, sin, layer.num_q_heads, layer.k_eq_v, slots, self.cu_q, self.kv_lens, table, first, k_off, v_off,
            page, layer.num_kv_heads, window_left(layer.window), 1.0)


class RealRows:
    """An attention callable on the first `t` rows of a step computed at `padded` rows (`padded_forward`): the
    padded rows' output is zero. It hands a packed layer's projection on as `attention` takes it (`attend`)."""

    def __init__(self, attention, t: int, padded: int):
        self.attention, self.t, self.padded = attention, t, padded

    def _pad(self, o):
        return torch.cat([o, o.new_zeros((self.padded - self.t, *o.shape[1:]))])

    def __call__(self, layer: LayerKV, q, k, v):
        t = self.t
        return self._pad(self.attention(layer, q[:t], None if k is None else k[:t], None if v is None else v[:t]))

    def from_projection(self, attn, y, cos, sin):
        t = self.t
        return self._pad(attend(self.attention, attn, y[:t], cos[:t], sin[:t]))


def padded_forward(model: Gemma4Model, token_ids, positions, attention):
    """`model(token_ids, positions, attention)` computed on `token_bucket(T)` rows: token ids and
    positions padded with token 0 at position 0, the attention calls on the real T rows (`RealRows`).
    Returns the hidden rows of all of them; the first T are the real ones."""
    t = token_ids.shape[0]
    padded = token_bucket(t)
    if padded == t:
        return model(token_ids, positions, attention)
    pad = token_ids.new_zeros(padded - t)
    return model(torch.cat([token_ids, pad]), torch.cat([positions, pad]), RealRows(attention, t, padded))
