"""The reference KV cache: per sequence, per cache-owning layer, contiguous K and V of every position.

`LinearCache` is the model's `attention` callable for one varlen step. Every query of a sequence
attends over that sequence's whole contiguous cache through `plugins.reference.attend`, the same
function the paged reference op calls, with the window enforced by the mask only. Paged and linear
runs that hold the same keys are therefore byte-equal. It is slow and memory-hungry by design: it is
the oracle, and what `generate_linear` (tests) and `LinearEngine` (`g4rt generate --reference`) run.

Usage per step::

    cache.begin_step([seq_a, seq_b], [q_len_a, q_len_b])   # rows of the flat token axis, in order
    hidden = model(token_ids, positions, cache)             # positions must continue each sequence
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ..plugins.reference import attend, to_kv, window_left
from .layout import LayerKV, torch_dtype
from .model import Gemma4Model


class LinearCache:
    """`dtype`: what K and V are stored as (`to_kv`: a paged arena's KV dtype; None keeps the model's rows)."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self._k: dict[Hashable, dict[int, torch.Tensor]] = {}
        self._v: dict[Hashable, dict[int, torch.Tensor]] = {}
        self._len: dict[Hashable, int] = {}
        self._step: list[tuple[Hashable, int, int]] = []  # (seq_id, row_start, q_len)
        self._appended: set[tuple[Hashable, int]] = set()

    def seq_len(self, seq_id: Hashable) -> int:
        """Positions stored for `seq_id` (0 for an unknown sequence)."""
        return self._len.get(seq_id, 0)

    def begin_step(self, seq_ids: Sequence[Hashable], q_lens: Sequence[int]) -> None:
        """Declare the flat batch: sequence `seq_ids[b]` owns the next `q_lens[b]` rows, continuing
        at position `seq_len(seq_ids[b])`. Call once per model forward: the next `begin_step` (or `drop`)
        commits this step's positions first."""
        if len(seq_ids) != len(q_lens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError("begin_step needs one q_len per sequence and distinct sequence ids")
        self._commit()
        start, self._step = 0, []
        for sid, n in zip(seq_ids, q_lens):
            if n <= 0:
                raise ValueError(f"sequence {sid!r}: q_len must be positive")
            self._step.append((sid, start, int(n)))
            start += int(n)
            self._k.setdefault(sid, {})
            self._v.setdefault(sid, {})

    def _commit(self) -> None:
        """After a step's forward, advance each sequence's length by its query count."""
        for sid, _, n in self._step:
            self._len[sid] = self._len.get(sid, 0) + n
        self._step, self._appended = [], set()

    def drop(self, seq_id: Hashable) -> None:
        self._commit()
        for d in (self._k, self._v, self._len):
            d.pop(seq_id, None)

    def __call__(self, layer: LayerKV, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        if not self._step:
            raise RuntimeError("LinearCache: call begin_step before the model forward")
        out = torch.empty_like(q)
        for sid, s, n in self._step:
            if k is not None:
                self._append(sid, layer.index, k[s:s + n], v[s:s + n])
            past = self._len.get(sid, 0)
            k_all, v_all = self._k[sid][layer.source], self._v[sid][layer.source]
            if k_all.shape[0] != past + n:
                raise RuntimeError(f"layer {layer.index}: cache of layer {layer.source} holds {k_all.shape[0]} "
                                   f"positions, expected {past + n} (source must run before its readers)")
            q_pos = torch.arange(past, past + n, device=q.device)
            k_pos = torch.arange(past + n, device=q.device)
            out[s:s + n] = attend(q[s:s + n], k_all, v_all, q_pos, k_pos, window_left(layer.window), scale=1.0)
        return out

    def _append(self, sid: Hashable, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if (sid, layer) in self._appended:
            raise RuntimeError(f"layer {layer} wrote sequence {sid!r} twice in one step")
        self._appended.add((sid, layer))
        if self.dtype is not None:
            k, v = to_kv(k, self.dtype), to_kv(v, self.dtype)
        ks, vs = self._k[sid], self._v[sid]
        ks[layer] = k.clone() if layer not in ks else torch.cat([ks[layer], k])
        vs[layer] = v.clone() if layer not in vs else torch.cat([vs[layer], v])


@torch.inference_mode()
def generate_linear(model: Gemma4Model, prompt_ids: Sequence[int], max_new_tokens: int, *,
                    stop_ids: Sequence[int] = (), return_logits: bool = False):
    """Single-sequence greedy reference generation: one prefill step, then one token per step, each the
    first argmax of its logits (the oracle the runtime's greedy tokens are compared with; sampling is
    runtime/sampling.py's).

    Returns the generated ids (without the prompt); with `return_logits`, also the fp32 logits that
    chose each of them ([n, vocab]). Stops after a token in `stop_ids` (which is included).
    """
    if len(prompt_ids) == 0:
        raise ValueError("generate_linear needs a non-empty prompt")
    device = model.embed_tokens.weight.device
    cache, out, all_logits = LinearCache(torch_dtype(model.layout.dtype, kv=True)), [], []
    ids = torch.tensor(list(prompt_ids), dtype=torch.int64, device=device)
    pos = 0
    for _ in range(max_new_tokens):
        cache.begin_step([0], [ids.shape[0]])
        positions = torch.arange(pos, pos + ids.shape[0], device=device)
        hidden = model(ids, positions, cache)
        logits = model.logits(hidden[-1:])
        nxt = logits.argmax(dim=-1)
        pos += ids.shape[0]
        out.append(int(nxt))
        all_logits.append(logits[0])
        if out[-1] in stop_ids:
            break
        ids = nxt.to(torch.int64)
    return (out, torch.stack(all_logits)) if return_logits else out
