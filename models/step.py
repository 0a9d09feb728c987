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
CUDA-graph engine's static input buffers are all derived from `INPUTS`, which is read off the
`StepBatch` fields' dims: adding a field means adding it there and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

# Bump when the step graph's inputs/outputs change meaning: recorded in every engine manifest.
IO_CONTRACT_VERSION = 1

# Symbolic sizes of the step graph's dims: frames (arena), tokens T, seqs B, table widths of both
# groups, logits rows R; frame_elems is static. A dim is a symbol or a symbol plus a constant ("seqs+1").
SYMBOLS = ("frames", "tokens", "seqs", "sliding_pages", "full_pages", "rows")
OUTPUTS = ("logits", "arena_out")  # float32 [rows, vocab]; the arena after this step's writes


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. On CUDA it goes through pinned memory: a copy from pageable memory
    waits for the work already queued on the stream, which would stall the runtime's overlapped steps."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _dims(*dims: str):
    """A StepBatch field with its symbolic dims (read back as `INPUTS`)."""
    return field(metadata={"dims": dims})


@dataclass
class StepBatch:
    token_ids: torch.Tensor = _dims("tokens")
    positions: torch.Tensor = _dims("tokens")
    cu_q: torch.Tensor = _dims("seqs+1")
    kv_lens: torch.Tensor = _dims("seqs")
    sliding_table: torch.Tensor = _dims("seqs", "sliding_pages")
    sliding_first: torch.Tensor = _dims("seqs")
    sliding_slots: torch.Tensor = _dims("tokens")
    full_table: torch.Tensor = _dims("seqs", "full_pages")
    full_slots: torch.Tensor = _dims("tokens")
    logits_rows: torch.Tensor = _dims("rows")

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in contract order: the exported graph's inputs after the arena."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to(self, device) -> "StepBatch":
        """The batch on `device`, each tensor through `to_device`."""
        device = torch.device(device)
        return StepBatch(*(to_device(t, device) for t in self.tensors()))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.kv_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        """One token per sequence, each with its logits row: the shape the decode graphs replay."""
        return self.num_tokens == self.num_seqs == int(self.logits_rows.shape[0])


def padding_batch(seqs: int, sliding_pages: int = 1, full_pages: int = 1, device="cpu") -> StepBatch:
    """`seqs` dummy sequences of one token each: token 0 at position 0, kv_len 1, slots -1 (it writes
    nothing), tables 0 (it reads frame 0), logits row = its own row. The CUDA-graph engines pad batches
    with them and capture over them (runtime/engines/inductor.py, piecewise.py)."""
    def i32(fill, *shape):
        return torch.full(shape, fill, dtype=torch.int32, device=device)
    rows = torch.arange(seqs, dtype=torch.int32, device=device)
    return StepBatch(token_ids=i32(0, seqs), positions=i32(0, seqs),
                     cu_q=torch.arange(seqs + 1, dtype=torch.int32, device=device), kv_lens=i32(1, seqs),
                     sliding_table=i32(0, seqs, sliding_pages), sliding_first=i32(0, seqs), sliding_slots=i32(-1, seqs),
                     full_table=i32(0, seqs, full_pages), full_slots=i32(-1, seqs), logits_rows=rows)


# The step graph's inputs, name -> dims: the arena, then the StepBatch fields in contract order.
INPUTS: dict[str, tuple[str, ...]] = {"arena": ("frames", "frame_elems"),
                                      **{f.name: f.metadata["dims"] for f in fields(StepBatch)}}


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
