"""Token sampling for a whole step at once: greedy, temperature, top-k and top-p, seeded per request.

`BatchSampler` turns a step's logits `[R, V]` into `R` token ids on the logits' device with one op,
`g4rt::sample` (plugins/README.md: the Triton kernel plugins/triton_sampling.py on CUDA, its torch
reference plugins/reference.py `sample_ref` elsewhere); every row's settings are one tensor
(`SamplingRows`), there is no loop over rows, and the caller copies the chosen ids to the host once
per step. The same sampler serves every engine and the linear reference.

Reproducible streams whatever else is in the batch: a request's draw for its `n`-th token uses noise
that is a pure function of (its seed, `n`, vocabulary index) -- counter-based Philox, not a stateful
generator -- and every other step of the computation is per row. So the token a request samples
depends only on its own logits row, seed and draw count, not on which requests share the step, their
order, or the batch size (tests/test_runtime_sampling.py). (The logits must be equal too;
engines/eager.py says when they are.)

How a row samples. Greedy rows (temperature 0) take the argmax (first index among ties). Sampling
rows race: the token is the argmax over the kept set of `logits / T + G` with `G = -log(-log u)`
Gumbel noise (`u` uniform in [0, 1)), which picks token i with probability softmax(logits/T)_i
restricted to the kept set, needs one draw per entry, no normalisation and no cumulative-sum rounding.
Among equal race values the lowest vocabulary index wins.

Kept set, decided per row from the row's own settings only, on cut keys: how far an entry's score is
below the row's top, in steps of 2^-16 (scores closer than that are ties of the cut, never of the race):
* top-k (0 < k < V): the entries whose key is at most the k-th smallest key (ties with it are kept);
* top-p < 1: of those, the entries whose likelier entries (strictly smaller key) weigh less than top_p
  of the kept ones, the probabilities counted in integers (units of 2^-18 of the top entry's), so the
  cut does not depend on a summation order.
"""
from __future__ import annotations

import json
import logging
import random
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from g4rt.models.step import to_device
from g4rt.plugins.ops import check_kernels, sample


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
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) (the sampler's int64 seeds) or None, "
                             f"got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that change the distribution but that this engine does not implement: a model that
# sets one is generated without it, and a warning says so (a service request that sends one is refused,
# service/protocol._only)
_UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
log = logging.getLogger("g4rt.sampling")


@dataclass(frozen=True)
class GenerationDefaults:
    """The settings a request leaves out, from a model directory's generation_config.json as vLLM applies them
    by default (`--generation-config auto`): temperature, top_k, top_p and max_new_tokens where the file sets
    them, None where it does not (the caller's own default then: the OpenAI API's in the service, greedy and
    16 tokens in `g4rt generate`), and its `eos_token_id`, which ends a sequence as config.json's do (HF's
    generate and vLLM stop at both). `do_sample` is kept for `g4rt generate`, which like HF's generate is greedy
    unless it is true; the service, like vLLM's, does not read it (a request that leaves out temperature samples
    at the file's or the API's 1)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool | None = None

    @classmethod
    def from_dir(cls, model_dir) -> "GenerationDefaults":
        """The file's settings (none without the file); ValueError naming the file and the key for a bad one."""
        path = Path(model_dir) / GENERATION_CONFIG
        if not path.is_file():
            return cls()
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: not a JSON object")
        given = {k: cfg[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens") if cfg.get(k) is not None}
        try:
            SamplingParams(**given)  # its checks name the key
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
        do_sample = cfg.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"{path}: do_sample must be true or false, got {do_sample!r}")
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {cfg['eos_token_id']!r}")
        ignored = sorted(k for k, neutral in _UNSUPPORTED.items() if cfg.get(k) not in (None, neutral))
        if ignored:
            log.warning("%s sets %s, which this engine does not implement: generated without", path,
                        ", ".join(ignored))
        return cls(**given, eos_token_ids=eos, do_sample=do_sample)

    def pick(self, name: str, given, fallback):
        """`given` (what the request or command line set) if not None, else the file's, else `fallback`."""
        if given is not None:
            return given
        mine = getattr(self, name)
        return fallback if mine is None else mine


def request_seed(params: SamplingParams) -> int:
    """The seed a request's stream uses: its own, or a fresh random one (then not reproducible)."""
    return params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)


class SamplingRows:
    """One step's per-row settings as one host tensor, so they reach the device in one copy.

    `pack` rows: temperature and top_p (float64 bits), top_k, seed, counter (the request's draw count:
    tokens it sampled before this one), int64 [5, R]. Temperature 0 is greedy; top_k 0 and top_p 1
    disable those filters. Built every step from Python sequences, so on the host's hot path: each
    column is one C conversion (`array`) into a buffer the tensor wraps, not a tensor copy of its own."""

    def __init__(self, temperature, top_k, top_p, seeds, counters):
        columns = (temperature, top_p, top_k, seeds, counters)
        if len({len(c) for c in columns}) != 1:
            raise ValueError(f"SamplingRows: temperature, top_p, top_k, seeds and counters must have one "
                             f"entry per row, got lengths {[len(c) for c in columns]}")
        buf = bytearray(array("d", temperature))
        buf += array("d", top_p)
        for column in columns[2:]:
            buf += array("q", column)
        self.pack = torch.frombuffer(buf, dtype=torch.int64).view(5, -1) if buf else \
            torch.empty((5, 0), dtype=torch.int64)
        self.nucleus = len(top_p) > 0 and min(top_p) < 1.0  # some row may cut by top-p (the op's hints)
        self.top_k = len(top_k) > 0 and max(top_k) > 0  # ... or by top-k

    def __len__(self) -> int:
        return int(self.pack.shape[1])


class BatchSampler:
    """Samples a step's rows on the logits' device; `__call__` returns int64 ids [R] on that device.

    One op, `g4rt::sample` (plugins/README.md), for every engine: the Triton kernel on CUDA, its torch
    reference elsewhere (`kernels` overrides the choice, as the engines' setting does). One host-to-device
    copy of the rows' settings per step, no loop over rows or groups of rows."""

    def __init__(self, kernels: str | None = None):
        self.kernels = None if kernels is None else check_kernels(kernels, "BatchSampler.kernels")

    def __call__(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [rows, vocab] with {len(rows)} rows, got {tuple(logits.shape)}")
        return sample(logits, to_device(rows.pack, logits.device), nucleus=rows.nucleus, top_k=rows.top_k,
                      kernels=self.kernels)
