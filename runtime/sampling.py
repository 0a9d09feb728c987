"""Token sampling: greedy, temperature, top-k, top-p, with a generator per request.

Reproducibility regardless of batching: each request owns a `torch.Generator` seeded from its
`seed` and draws exactly one exponential vector per generated token, so the token it samples
depends only on its own logits row and how many tokens it has drawn -- not on which other requests
share the step or in what order. (The logits themselves must be equal too; see engine.py.)

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which picks index i with
probability p_i, needs one draw per vocabulary entry, and has no cumulative-sum rounding.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One request's sampler: its params and its own generator (created on the logits' device)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
        self._gen: torch.Generator | None = None

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._gen is None:
            self._gen = torch.Generator(device=device)
            self._gen.manual_seed(self.seed)
        return self._gen

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: float32 [V] -> the next token id."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits.float() / p.temperature
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each entry
            drop = torch.zeros_like(probs, dtype=torch.bool)
            drop[order] = before >= p.top_p  # keep the smallest prefix reaching top_p (>= 1 entry)
            probs = probs.masked_fill(drop, 0.0)
        race = torch.empty_like(probs).exponential_(generator=self._generator(probs.device))
        return int(torch.argmax(probs / race))
