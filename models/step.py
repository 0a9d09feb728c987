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

The step graph's interface is defined here once: `INPUTS` (the arena, then the batch fields) with
their symbolic dims, and `OUTPUTS`. ONNX dynamic shapes, TensorRT optimisation profiles and the
CUDA-graph engine's static input buffers are all derived from `INPUTS`, so adding a field to
`StepBatch` means adding it to `INPUTS` and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Bump when the step graph's inputs/outputs change meaning: recorded in every engine manifest.
IO_CONTRACT_VERSION = 1

# Input name -> its dims, each a symbolic size or an (offset) of one: "seqs+1" is seqs + 1.
# frames / frame_elems: the arena; tokens: T; seqs: B; *_pages: table widths; rows: logits rows R.
INPUTS: dict[str, tuple[str, ...]] = {
    "arena": ("frames", "frame_elems"),
    "token_ids": ("tokens",),
    "positions": ("tokens",),
    "cu_q": ("seqs+1",),
    "kv_lens": ("seqs",),
    "sliding_table": ("seqs", "sliding_pages"),
    "sliding_first": ("seqs",),
    "sliding_slots": ("tokens",),
    "full_table": ("seqs", "full_pages"),
    "full_slots": ("tokens",),
    "logits_rows": ("rows",),
}
OUTPUTS = ("logits", "arena_out")  # float32 [rows, vocab]; the arena after this step's writes
SYMBOLS = ("frames", "tokens", "seqs", "sliding_pages", "full_pages", "rows")  # frame_elems is static


def dim_symbol(dim: str) -> tuple[str, int]:
    """'seqs+1' -> ('seqs', 1); 'tokens' -> ('tokens', 0)."""
    name, _, plus = dim.partition("+")
    return name, int(plus or 0)


def input_shape(name: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """The concrete shape of input `name` for symbol sizes `sizes` (e.g. a bucket of the CUDA-graph
    engine or a TensorRT profile point)."""
    out = []
    for dim in INPUTS[name]:
        sym, plus = dim_symbol(dim)
        if sym not in sizes:
            raise KeyError(f"input {name!r} needs a size for {sym!r}")
        out.append(sizes[sym] + plus)
    return tuple(out)


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

    @classmethod
    def input_names(cls) -> tuple[str, ...]:
        """The step graph's inputs: the arena, then the fields in contract order."""
        return ("arena",) + cls.names()

    def to(self, device) -> "StepBatch":
        return StepBatch(*(t.to(device, non_blocking=True) for t in self.tensors()))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])


if tuple(INPUTS) != StepBatch.input_names():  # the contract and the dataclass must not drift apart
    raise AssertionError(f"models.step.INPUTS {tuple(INPUTS)} != arena + StepBatch fields {StepBatch.input_names()}")
