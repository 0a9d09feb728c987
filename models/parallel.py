"""Tensor parallelism: which slice of every weight and KV head a rank holds, and the model that runs it.

The rule (DESIGN.md §8.2), for `tp` ranks of one host, rank `r`:

* **Attention.** Query heads split evenly: rank r holds heads `[r*Hq/tp, (r+1)*Hq/tp)`, so q_proj is
  column-parallel (its rows) and o_proj row-parallel (its columns), followed by one all-reduce. KV heads
  split evenly when `tp <= Hkv`; when `tp > Hkv` each rank holds the one KV head its query heads read
  (head `r*Hkv // tp`), so that head is *replicated* on tp/Hkv ranks. Both cases are one formula:
  rank r holds `max(1, Hkv/tp)` KV heads from `r*Hkv // tp`. k_eq_v layers split k_proj like any K
  (V is v_norm of the same local rows); KV-shared layers hold only q_proj/o_proj.
* **Dense MLP.** gate/up column-parallel, down row-parallel, one all-reduce.
* **MoE experts.** Every rank holds every expert, sliced like the dense MLP along
  moe_intermediate_size (gate_up rows of both halves, down columns), one all-reduce; the router is
  replicated, so every rank picks the same experts. (Expert parallelism, E/tp whole experts per rank,
  is the alternative: at batch 1 its slowest rank holds more than top_k/tp of the chosen experts.)
* **Embeddings.** embed_tokens (and the tied lm_head) and E2B/E4B's per-layer table are split by
  vocabulary rows: a lookup reads the local rows, zeros elsewhere, then one all-reduce (exact: every
  other rank adds 0); the logits are each rank's vocab columns, gathered.
* Everything else (norms, layer_scalar, router, PLE projections) is replicated.

A rank's model is `Gemma4Model` built from `rank_config(cfg, tp)` (the config with per-rank head and
intermediate counts, so every column-parallel Linear already has its local shape and `model.layout`
is the rank's KV layout: its page geometry and arena come from it as on one GPU), with the row-parallel
and vocab-parallel modules replaced by the classes below. `shard_plan` is the rule as data: for each
sharded tensor, the dim and the index ranges rank r reads from the checkpoint. The residual stream is
identical on every rank after each all-reduce.

`tp == 1` never communicates (the collectives return their input), but the runtime does not take this
path at TP 1 at all: it loads the plain model (cli.py).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .checkpoint import load_into, model_shapes, random_into, to_dtype
from .config import Gemma4Config, load_config
from .layout import KVLayout
from .model import Experts, Gemma4Model, Linear

TP_SIZES = (1, 2, 4, 8)


class ParallelError(ValueError):
    pass


def check_tensor_parallel(cfg: Gemma4Config, tp: int) -> int:
    """`tp` if `cfg` splits over that many ranks by the rule above, else an error naming the field."""
    if tp not in TP_SIZES:
        raise ParallelError(f"tensor_parallel: {tp} is not one of {', '.join(map(str, TP_SIZES))}")
    even = {"num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size,
            **{f"intermediate size of layer {i}": cfg.layer_intermediate(i) for i in range(cfg.num_hidden_layers)}}
    if cfg.has_ple:
        even["vocab_size_per_layer_input"] = cfg.vocab_size_per_layer_input
    if cfg.enable_moe_block:
        even["moe_intermediate_size"] = cfg.moe_intermediate_size
    for name, n in even.items():
        if n % tp:
            raise ParallelError(f"tensor_parallel {tp}: {name} = {n} does not split over {tp} ranks")
    for name in ("num_key_value_heads", "num_global_key_value_heads"):
        kv = getattr(cfg, name)
        if kv and kv % tp and tp % kv:
            raise ParallelError(f"tensor_parallel {tp}: {name} = {kv} neither splits over {tp} ranks nor divides {tp}")
    return tp


def _local_kv(heads: int, tp: int) -> int:
    return max(1, heads // tp)


def rank_config(cfg: Gemma4Config, tp: int) -> Gemma4Config:
    """The config of what one rank computes: per-rank query/KV heads and intermediate sizes. Its
    `KVLayout` / `PageGeometry` are the rank's arena; every rank has the same."""
    check_tensor_parallel(cfg, tp)
    g = cfg.num_global_key_value_heads
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=_local_kv(cfg.num_key_value_heads, tp),
        num_global_key_value_heads=None if g is None else _local_kv(g, tp),
        intermediate_size=cfg.intermediate_size // tp,
        moe_intermediate_size=None if cfg.moe_intermediate_size is None else cfg.moe_intermediate_size // tp)


def _even(n: int, tp: int, rank: int) -> range:
    return range(rank * n // tp, (rank + 1) * n // tp)


def _kv_heads(n: int, tp: int, rank: int) -> range:
    start = rank * n // tp
    return range(start, start + _local_kv(n, tp))


def _rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def shard_plan(cfg: Gemma4Config, tp: int, rank: int) -> dict[str, tuple[int, tuple[range, ...]]]:
    """Model tensor name -> (dim, index ranges along it) that rank `rank` of `tp` holds, concatenated in
    order. Names not in the plan are replicated."""
    check_tensor_parallel(cfg, tp)
    plan = {"embed_tokens.weight": (0, (_even(cfg.vocab_size, tp, rank),))}
    if cfg.has_ple:
        plan["embed_tokens_per_layer.weight"] = (0, (_even(cfg.vocab_size_per_layer_input, tp, rank),))
    for kv in KVLayout.from_config(cfg).layers:
        p = f"layers.{kv.index}."
        q = _rows(_even(kv.num_q_heads, tp, rank), kv.head_dim)
        plan[p + "self_attn.q_proj.weight"] = (0, (q,))
        plan[p + "self_attn.o_proj.weight"] = (1, (q,))
        if kv.owns_cache:
            k = _rows(_kv_heads(kv.num_kv_heads, tp, rank), kv.head_dim)
            plan[p + "self_attn.k_proj.weight"] = (0, (k,))
            if not kv.k_eq_v:
                plan[p + "self_attn.v_proj.weight"] = (0, (k,))
        i = _even(cfg.layer_intermediate(kv.index), tp, rank)
        plan[p + "mlp.gate_proj.weight"] = plan[p + "mlp.up_proj.weight"] = (0, (i,))
        plan[p + "mlp.down_proj.weight"] = (1, (i,))
        if cfg.enable_moe_block:
            n = cfg.moe_intermediate_size
            m = _even(n, tp, rank)
            plan[p + "experts.gate_up_proj"] = (1, (m, range(n + m.start, n + m.stop)))  # gate rows, up rows
            plan[p + "experts.down_proj"] = (2, (m,))
    return plan


def take_shard(t, dim: int, ranges: tuple[range, ...]) -> torch.Tensor:
    """The rows `ranges` along `dim` of `t`: a tensor, or a safetensors slice (which then reads only them)."""
    lead = (slice(None),) * dim
    parts = [t[lead + (slice(r.start, r.stop),)] for r in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


# ---- collectives (over the default process group: one model per process) ---------------------------

# Gather along dim 0: `all_gather_single` where torch has it (2.13 here); the GPU image's torch 2.11 has only
# `all_gather_tensor`, which later torch deprecates in its favour.
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Sum over ranks (functional: traceable by torch.compile and capturable in CUDA graphs)."""
    if tp == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))


def all_gather_last(x: torch.Tensor, tp: int) -> torch.Tensor:
    """[R, n] on each rank -> [R, tp * n], rank order along the last dim."""
    if tp == 1:
        return x
    g = funcol.wait_tensor(_ALL_GATHER(x.contiguous(), 0, dist.group.WORLD))
    return g.view(tp, *x.shape).transpose(0, 1).reshape(x.shape[0], tp * x.shape[1])


class RowParallelLinear(Linear):
    """A Linear holding this rank's input columns; the partial products are summed over ranks."""

    def __init__(self, n_in: int, n_out: int, tp: int, dtype, device):
        super().__init__(n_in, n_out, bias=False, dtype=dtype, device=device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.tp)


class VocabParallelEmbedding(nn.Module):
    """Rows `[start, start + n)` of an embedding table; other ids look up 0 here, and the sum over ranks
    is the full lookup, bit for bit (each id is found on exactly one rank)."""

    def __init__(self, num: int, dim: int, tp: int, rank: int, dtype, device):
        super().__init__()
        self.tp, self.start = tp, rank * (num // tp)
        self.weight = nn.Parameter(torch.empty(num // tp, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        here = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(here, local, 0), self.weight).masked_fill(~here[:, None], 0)
        return all_reduce(out, self.tp)


class ParallelExperts(Experts):
    """The experts sliced along moe_intermediate_size (the rank config's); partial outputs summed."""

    def __init__(self, cfg: Gemma4Config, tp: int, dtype, device):
        super().__init__(cfg, dtype, device)
        self.tp = tp

    def forward(self, x, idx, w):
        return all_reduce(super().forward(x, idx, w), self.tp)


class ParallelGemma4Model(Gemma4Model):
    """Rank `rank` of `tp`: `Gemma4Model(rank_config(cfg, tp))` with o_proj / down_proj row-parallel,
    the experts' sums reduced, the embeddings vocab-parallel and the logits gathered. `config` is the
    rank's config (its layout is the rank's KV layout)."""

    def __init__(self, cfg: Gemma4Config, tp: int, rank: int, dtype: torch.dtype = torch.bfloat16, device=None,
                 kernels: str | None = None):
        if not 0 <= rank < tp:
            raise ParallelError(f"rank {rank} is not in [0, {tp})")
        local = rank_config(cfg, tp)
        super().__init__(local, dtype=dtype, device=device, kernels=kernels)
        self.tp, self.rank = tp, rank
        H = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, H, tp, rank, dtype, device)
        if cfg.has_ple:
            P = cfg.num_hidden_layers * cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.vocab_size_per_layer_input, P, tp, rank, dtype,
                                                                 device)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.o_proj.in_features, H, tp, dtype, device)
            mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, H, tp, dtype, device)
            if layer.has_moe:
                layer.experts = ParallelExperts(local, tp, dtype, device)
        self.set_kernels(self.kernels)  # the new modules take the model's kernels too

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's vocab columns, gathered in the model dtype (the values are model-dtype ones); into `out`
        where given, as `Gemma4Model.logits`."""
        whole = all_gather_last(super().logits(hidden).to(self.dtype), self.tp).float()
        return whole if out is None else out.copy_(whole)


# ---- loading ----------------------------------------------------------------------------------------

def _rank_model(cfg: Gemma4Config, tp: int, rank: int, dtype: torch.dtype):
    """Rank `rank`'s model on the meta device and `take(name, t)`, its part of a full tensor `t` (a tensor
    or a safetensors slice), after checking each of its tensors has the shape the shard plan gives it."""
    model = ParallelGemma4Model(cfg, tp, rank, dtype=dtype, device="meta")
    plan = shard_plan(cfg, tp, rank)
    full = model_shapes(cfg)
    for name, t in model.state_dict().items():
        shape = list(full[name])
        if name in plan:
            dim, ranges = plan[name]
            shape[dim] = sum(len(r) for r in ranges)
        if tuple(t.shape) != tuple(shape):
            raise ParallelError(f"{name}: the rank model holds {tuple(t.shape)}, the shard plan gives {tuple(shape)}")

    def take(name: str, t):
        return take_shard(t, *plan[name]) if name in plan else t[...]
    return model, take


def load_rank_model(ckpt_dir: str | Path, tp: int, rank: int, dtype: str | torch.dtype | None = None,
                    device="cpu", kernels: str | None = None) -> ParallelGemma4Model:
    """Rank `rank`'s model read from a checkpoint directory by `checkpoint.load_into`: names and full
    shapes checked from the headers as for one GPU, then each tensor's rank slice read through
    safetensors' `get_slice` (only those bytes), replicated tensors whole."""
    cfg = load_config(ckpt_dir)
    model, take = _rank_model(cfg, tp, rank, to_dtype(dtype, cfg))
    return load_into(model, cfg, ckpt_dir, device, kernels, take)


def random_rank_model(cfg: Gemma4Config, tp: int, rank: int, dtype: torch.dtype = torch.bfloat16, device="cpu",
                      seed: int = 0, kernels: str | None = None, init: str = "default") -> ParallelGemma4Model:
    """Rank `rank`'s slices of `checkpoint.random_model(cfg, ..., seed)`, bit for bit (`random_into`:
    every full tensor drawn in the same order from the same generator, then sliced, one at a time on
    the device). GPU benchmarks of the published sizes use it."""
    model, take = _rank_model(cfg, tp, rank, dtype)
    return random_into(model, cfg, device, seed, kernels, init, take)
