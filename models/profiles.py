"""Step-size bounds of a compiled engine: derived from the scheduler limits it was built for,
recorded in its manifest (`profiles`), and checked against every step before it runs.

A TensorRT plan accepts only shapes inside its optimization profile; a step outside it fails deep
in `execute_async_v3` (or, for a table wider than the profile, not at all before reading past it).
So the bounds come from the limits the runtime's scheduler will obey, not from constants:

* tokens (T) <= max_batched_tokens, the scheduler's max_num_batched_tokens;
* seqs (B) and logits rows (R) <= max_seqs;
* sliding table width <= the sliding pages one request holds while computing a chunk
  (PageGeometry.sliding_pages_per_request, `chunk` being the scheduler's), and never more than the
  model length needs;
* full table width <= the full pages of max_model_len positions;
* frames <= max_frames (the arena), which also caps both widths.

Each bound is (min, opt, max); opt is the steady decode state of a full batch (T = B = max_seqs,
every table at its widest, the whole arena), where TensorRT picks its tactics. `check_step` refuses a
step outside the bounds by the symbol's name and the `g4rt build` flags that set it; any engine whose
manifest has profiles runs it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .layout import PageGeometry
from .step import INPUTS, SYMBOLS, dim_symbol, input_shape

# The `g4rt build` flags behind each bound (derive_profiles: the least of what they allow), for error messages.
FLAGS = {"tokens": ("--max-batched-tokens",), "seqs": ("--max-seqs",), "rows": ("--max-seqs",),
         "sliding_pages": ("--chunk", "--max-model-len", "--max-frames"),
         "full_pages": ("--max-model-len", "--max-frames"), "frames": ("--max-frames",)}


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class StepLimits:
    """What the runtime's scheduler may hand an engine in one step (see the module docstring)."""

    max_batched_tokens: int
    chunk: int
    max_seqs: int
    max_frames: int
    max_model_len: int

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"step limit {name} must be a positive integer, got {value!r}")
        if self.chunk > self.max_batched_tokens:
            raise ValueError(f"chunk ({self.chunk}) must not exceed max_batched_tokens ({self.max_batched_tokens})")
        if self.max_seqs > self.max_batched_tokens:
            raise ValueError(f"max_seqs ({self.max_seqs}) must not exceed max_batched_tokens "
                             f"({self.max_batched_tokens}): "
                             f"every sequence of a step has at least one token")


def derive_profiles(limits: StepLimits, geometry: PageGeometry) -> dict[str, list[int]]:
    """{symbol: [min, opt, max]} for every dynamic dim of the step graph (models.step.SYMBOLS)."""
    frames = limits.max_frames
    sliding = min(geometry.sliding_pages_per_request(limits.chunk) or 1,
                  geometry.pages_for("sliding", limits.max_model_len), frames)
    full = min(geometry.pages_for("full", limits.max_model_len), frames)
    top = {"tokens": limits.max_batched_tokens, "seqs": limits.max_seqs, "rows": limits.max_seqs,
           "sliding_pages": sliding, "full_pages": full, "frames": frames}  # each >= 1 (StepLimits are)
    opt = dict(top, tokens=limits.max_seqs)
    assert set(top) == set(SYMBOLS), "a step symbol without a bound"
    return {sym: [1, opt[sym], top[sym]] for sym in SYMBOLS}


def profile_shapes(profiles: dict, frame_elems: int) -> dict[str, tuple]:
    """Input name -> (min shape, opt shape, max shape), from the symbol bounds through the contract."""
    points = [{**{s: b[i] for s, b in profiles.items()}, "frame_elems": frame_elems} for i in range(3)]
    return {name: tuple(input_shape(name, p) for p in points) for name in INPUTS}


def step_sizes(feeds: dict) -> dict[str, int]:
    """Symbol sizes of one step, read through the contract from the shapes of its inputs (name ->
    tensor or array: every engine's feeds and the golden steps)."""
    sizes = {}
    for name, dims in INPUTS.items():
        for dim, n in zip(dims, feeds[name].shape):
            sym, plus = dim_symbol(dim)
            if sym in SYMBOLS:
                sizes.setdefault(sym, int(n) - plus)
    return sizes


def check_step(profiles: dict, sizes: dict[str, int]) -> None:
    """Raise ProfileError naming the first symbol of `sizes` outside its profile bound."""
    for sym, (lo, _, hi) in profiles.items():
        n = sizes.get(sym)
        if n is not None and not lo <= n <= hi:
            flags = FLAGS.get(sym, (sym,))
            if len(flags) == 1:
                advice = f"rebuild the engine with a larger {flags[0]}"
            else:
                advice = (f"the bound is the least of what {', '.join(flags[:-1])} and {flags[-1]} allow; rebuild "
                          f"the engine with larger ones")
            raise ProfileError(f"step has {sym} = {n}, outside the engine's profile [{lo}, {hi}]; {advice} or keep "
                               f"the scheduler within it")
