"""Torch reference of the attention math: the oracle every kernel and cache backend is compared with.

`attend` is the single definition of Gemma 4's attention over one sequence's keys. The model's
linear cache and the paged reference op both call it, so paged and linear runs are byte-equal when
they hold the same keys.
"""
from __future__ import annotations

import torch


def window_left(window: int | None) -> int:
    """Gemma's window W counts the current token (a query at p sees p-W+1 .. p); kernels take the
    inclusive left distance W-1 (FlashInfer's `window_left`). -1 means no window."""
    return -1 if window is None else window - 1


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           window_left: int, scale: float = 1.0) -> torch.Tensor:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D], positions int [Tq] / [Tk] -> [Tq, Hq, D] in q's dtype.

    Causal (k_pos <= q_pos) and, when window_left >= 0, k_pos >= q_pos - window_left. Scores,
    softmax and the weighted sum are fp32. A query that sees no key returns zeros.
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, Tk, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        allowed = allowed & (k_pos[None, :] >= q_pos[:, None] - window_left)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no key: all -inf -> nan -> 0
    out = torch.matmul(probs, vf)  # [Hq, Tq, D]
    return out.transpose(0, 1).to(q.dtype)
