"""The step contract: what the runtime hands an engine once per step.

One step computes a flattened, varlen batch of B sequences: each contributes a run of query tokens
(a prefill chunk or one decode token). Every tensor is int32 so the same batch feeds the eager
torch engine, the exported ONNX graph and a TensorRT engine unchanged.

Conventions (shared with the plugin ops, see plugins/README.md):

* ``cu_q[b] : cu_q[b+1]`` are sequence b's query rows in the flat token axis (``cu_q[0] == 0``).
* ``kv_lens[b]`` counts sequence b's positions *after* this step's tokens are written, so query i of
  sequence b sits at absolute position ``kv_lens[b] - q_len_b + i`` (equal to ``positions``).
* A *slot* is ``frame * page_tokens + offset_in_page`` for that group's page geometry; -1 skips.
* ``*_table[b, j]`` is the arena frame that holds logical page ``first_page[b] + j`` of sequence b.
  The full group always starts at page 0; the sliding group's table holds only resident pages.
  Entries past a sequence's last page are never read (the runtime fills them with 0).
* ``logits_rows`` picks the flat rows whose logits the runtime needs (usually each sequence's last).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class StepBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    cu_q: torch.Tensor  # [B+1]
    kv_lens: torch.Tensor  # [B]
    sliding_table: torch.Tensor  # [B, Ms]
    sliding_first: torch.Tensor  # [B]
    sliding_slots: torch.Tensor  # [T]
    full_table: torch.Tensor  # [B, Mf]
    full_slots: torch.Tensor  # [T]
    logits_rows: torch.Tensor  # [R]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in contract order: the exported graph's inputs after the arena."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to(self, device) -> "StepBatch":
        return StepBatch(*(t.to(device, non_blocking=True) for t in self.tensors()))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])
