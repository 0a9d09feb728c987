"""The step graph: the model over the paged KV arena, one varlen step per call.

`PagedStep.forward(arena, *StepBatch.tensors())` runs the model on the step's flat token axis. Each
cache-owning layer scatters its new K/V rows into the arena and attends (`g4rt::kv_write_attention_`, whose Triton
kernels make a decode step's write part of the attention launch; when exporting, the functional `g4rt::kv_write`
and then `g4rt::paged_attention`, the ONNX graph's two plugins); a KV-shared layer
only attends, using its source layer's K/V offsets (`PageGeometry.layer_offsets`). Sliding layers use
the sliding page table / first page / slots, full layers the full ones with first page 0.

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
from .model import Gemma4Model


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
                       full_slots):
        """The model's `attention(layer, q, k, v)` callback over `arena` for one step's metadata, and the
        dict whose "arena" is the arena after its writes (a new tensor when functional)."""
        geo = self.geometry
        groups = self._groups(kv_lens, sliding_table, sliding_first, sliding_slots, full_table, full_slots)
        state = {"arena": arena}
        kernels = self.model.kernels

        def attention(layer: LayerKV, q, k, v):
            table, first, slots, page = groups[layer.sliding]
            k_off, v_off = geo.layer_offsets(layer.index)
            rest = (k_off, v_off, page, layer.num_kv_heads, window_left(layer.window), 1.0, kernels)
            if k is not None and not self.functional:  # one op: a decode step's write is the attention launch's
                return torch.ops.g4rt.kv_write_attention_(state["arena"], k, v, slots, q, cu_q, kv_lens, table, first,
                                                          *rest)
            if k is not None:
                state["arena"] = torch.ops.g4rt.kv_write(state["arena"], k, v, slots, k_off, v_off, page, kernels)
            return torch.ops.g4rt.paged_attention(q, state["arena"], cu_q, kv_lens, table, first, *rest)
        return attention, state

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
                full_table, full_slots, logits_rows):
        attention, state = self.attention_over(arena, cu_q, kv_lens, sliding_table, sliding_first, sliding_slots,
                                               full_table, full_slots)
        hidden = (padded_forward(self.model, token_ids, positions, attention) if self.pad_tokens
                  else self.model(token_ids, positions, attention))
        logits = self.model.logits(hidden.index_select(0, logits_rows.long()))
        return (logits, state["arena"]) if self.functional else logits


def padded_forward(model: Gemma4Model, token_ids, positions, attention):
    """`model(token_ids, positions, attention)` computed on `token_bucket(T)` rows: token ids and
    positions padded with token 0 at position 0, the attention calls on the real T rows (the padded
    rows' output is zero). Returns the hidden rows of all of them; the first T are the real ones."""
    t = token_ids.shape[0]
    padded = token_bucket(t)
    if padded == t:
        return model(token_ids, positions, attention)
    pad = token_ids.new_zeros(padded - t)

    def real_rows(layer: LayerKV, q, k, v):
        o = attention(layer, q[:t], None if k is None else k[:t], None if v is None else v[:t])
        return torch.cat([o, o.new_zeros((padded - t, *o.shape[1:]))])
    return model(torch.cat([token_ids, pad]), torch.cat([positions, pad]), real_rows)
