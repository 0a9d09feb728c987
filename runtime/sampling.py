"""Token sampling for a whole step at once: greedy, temperature, top-k and top-p, seeded per request.

`BatchSampler` turns a step's logits `[R, V]` into `R` token ids on the logits' device in a few
torch ops; every row's settings are tensors (`SamplingRows`), there is no loop over rows, and the
caller copies the chosen ids to the host once per step. The same sampler serves every engine and
the linear reference.

Reproducible streams whatever else is in the batch: a request's draw for its `n`-th token uses noise
that is a pure function of (its seed, `n`, vocabulary index) -- a counter-based hash, not a stateful
generator -- and every other step of the computation is per row. So the token a request samples
depends only on its own logits row, seed and draw count, not on which requests share the step, their
order, or the batch size (tests/test_runtime_sampling.py). (The logits must be equal too;
engines/eager.py says when they are.)

How a row samples. Greedy rows (temperature 0) take the argmax (first index among ties). Sampling
rows race: the token is argmax over the kept set of `logits / T + G` with `G = -log(-log u)` Gumbel
noise from the hash (`u` uniform in (0, 1)), which picks token i with probability softmax(logits/T)_i
restricted to the kept set, needs one draw per entry, no normalisation and no cumulative-sum rounding.

Kept set, decided per row from the row's own settings only:
* top-k (k > 0): the row's candidates are its `width = next_power_of_two(k)` highest scores
  (`torch.topk`); of those it keeps every one >= the k-th highest (ties with the k-th are kept, up to
  the width). Rows are grouped by width, so a row's candidate count never depends on another row's k.
* no top-k: every vocabulary entry is a candidate (one more group).
* top-p < 1: of the candidates left, the smallest set of highest-probability ones whose mass reaches
  top_p (probabilities in float64, over that row's candidates).
Among equal race values the lowest vocabulary index wins, in both kinds of group.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from g4rt.models.step import to_device


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. `temperature == 0` is greedy (top_k/top_p ignored)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed (the output is then not reproducible)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # True: only stop_token_ids and max_new_tokens end the request

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def request_seed(params: SamplingParams) -> int:
    """The seed a request's stream uses: its own, or a fresh random one (then not reproducible)."""
    return params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (hash-prospector's two-multiply xorshift family) on int64 tensors
    holding values in [0, 2^32). Both multipliers are below 2^31, so no product leaves int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def _row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from (seed, counter), both int64 [R]: an odd multiplier and an offset."""
    k = _mix32(seeds & _M32)
    k = _mix32(k ^ ((seeds >> 32) & _M32))
    k = _mix32(k ^ (counters & _M32))
    k = _mix32(k ^ ((counters >> 32) & _M32))
    return k | 1, _mix32(k ^ 0x5BD1E995)


def gumbel(seeds: torch.Tensor, counters: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gumbel noise G(seed, counter, vocabulary index), float32 `[R, N]`.

    seeds, counters: int64 [R]; index: int64 `[N]` or `[R, N]` vocabulary ids. The value for one
    (seed, counter, id) is the same whatever the other rows and ids are: this is what makes a
    request's stream independent of the batch."""
    mult, offset = _row_keys(seeds, counters)
    idx = index if index.dim() == 2 else index[None, :]
    x = _mix32((idx * mult[:, None] + offset[:, None]) & _M32)  # idx < 2^31, mult < 2^32: fits int64
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


class SamplingRows:
    """One step's per-row settings as one host tensor, so they reach the device in one copy.

    `pack` rows: temperature and top_p (float64 bits), top_k, seed, counter (the request's draw count:
    tokens it sampled before this one), int64 [5, R]. Temperature 0 is greedy; top_k 0 and top_p 1
    disable those filters."""

    def __init__(self, temperature, top_k, top_p, seeds, counters):
        self.pack = torch.empty((5, len(temperature)), dtype=torch.int64)
        floats = self.pack[:2].view(torch.float64)
        floats[0] = torch.as_tensor(temperature, dtype=torch.float64)
        floats[1] = torch.as_tensor(top_p, dtype=torch.float64)
        self.pack[2] = torch.as_tensor(top_k, dtype=torch.int64)
        self.pack[3] = torch.as_tensor(seeds, dtype=torch.int64)
        self.pack[4] = torch.as_tensor(counters, dtype=torch.int64)

    def __len__(self) -> int:
        return int(self.pack.shape[1])

    @property
    def temperature(self) -> torch.Tensor:
        return self.pack[0].view(torch.float64)

    @property
    def top_k(self) -> torch.Tensor:
        return self.pack[2]

    def groups(self, vocab: int) -> dict[int, torch.Tensor]:
        """Sampling rows by candidate width (0: the whole vocabulary), host int64 row indices each."""
        sampled = self.temperature > 0.0
        if not bool(sampled.any()):
            return {}
        k = self.top_k
        pow2 = torch.where(k > 1, torch.ones_like(k) << torch.ceil(torch.log2(k.clamp(min=1).double())).long(), k)
        width = torch.where((k > 0) & (k < vocab), pow2.clamp(max=vocab), 0)
        return {int(w): torch.nonzero(sampled & (width == w)).flatten() for w in torch.unique(width[sampled]).tolist()}


def _race(scores: torch.Tensor, ids: torch.Tensor | None, top_p: torch.Tensor, seeds: torch.Tensor,
          counters: torch.Tensor) -> torch.Tensor:
    """Sample one id per row of `scores` ([G, N] float32, -inf where not a candidate), whose columns are
    the vocabulary ids `ids` ([G, N]; None: column j is id j). top_p [G] float64 filters by mass."""
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(scores.double(), dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        above = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each entry
        drop_sorted = above >= top_p[:, None]  # keeps the smallest prefix reaching top_p (>= 1 entry)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    vocab_ids = ids if ids is not None else torch.arange(scores.shape[1], device=scores.device)[None, :]
    z = scores + gumbel(seeds, counters, vocab_ids)
    best = z.max(dim=-1, keepdim=True).values
    return torch.where(z == best, vocab_ids, torch.iinfo(torch.int64).max).min(dim=-1).values


class BatchSampler:
    """Samples a step's rows on the logits' device; `__call__` returns int64 ids [R] on that device.

    Cost: greedy rows are one argmax over the step. Sampling rows with top-k cost a `torch.topk` of
    their width; rows without top-k hash one noise value per vocabulary entry (and sort the vocabulary
    when they also ask for top-p). Python runs once per group of rows, never per row."""

    def __call__(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [rows, vocab] with {len(rows)} rows, got {tuple(logits.shape)}")
        out = logits.argmax(dim=-1)
        groups = rows.groups(logits.shape[1])
        if not groups:
            return out
        dev = logits.device
        pack = to_device(rows.pack, dev)
        floats = pack[:2].view(torch.float64)
        for width, members in groups.items():
            sel = to_device(members, dev)
            temp, top_p = floats[0, sel].float(), floats[1, sel]
            top_k, seeds, counters = pack[2, sel], pack[3, sel], pack[4, sel]
            scores = logits.index_select(0, sel).float() / temp[:, None]
            if width == 0:
                chosen = _race(scores, None, top_p, seeds, counters)
            else:
                vals, ids = torch.topk(scores, width, dim=-1, sorted=True)
                kth = vals.gather(1, (top_k - 1)[:, None])
                chosen = _race(vals.masked_fill(vals < kth, float("-inf")), ids, top_p, seeds, counters)
            out.index_copy_(0, sel, chosen)
        return out
