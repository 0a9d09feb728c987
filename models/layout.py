"""The KV layout: every number about Gemma 4's caches, derived from the config in one place.

Gemma 4 caches in two groups that differ in head dim and in lifetime:

* the **sliding** group (head_dim 256, window W = 512 or 1024 keys counting the current token): a
  request needs only its last W-1 positions plus the tokens of the step being computed;
* the **full** group (head_dim 512; on k_eq_v sizes fewer KV heads): a request needs every position.

KV-shared layers (E2B/E4B) own no cache; they read the cache of `kv_source`. Kernels, export, the
page pools and `g4rt plan` all read this module; nothing else derives these numbers.

Pages. Both groups take pages from one arena of equal-sized *frames* so memory can move between
the groups as the workload shifts. A frame holds one page of either group: for every cache-owning
layer of that group a K block then a V block, each `[page_tokens, kv_heads, head_dim]`. The sliding
group's page has `page_tokens` positions; the full group gets as many positions as fit in the same
frame, rounded down to a multiple of `align` (so kernel tiles never straddle a page).

Frames are laid side by side, so a layer's pages lie a frame apart, and a batched decode reads one page from each
of hundreds of frames at once. A frame is padded to a whole number of granules (about 1/512 of it) whose odd
factor has no 3 or 5: GPUs' memory comes in five or six stacks (an 80 GB H100 has five, an H200 six),
and a stride whose odd factor shares a prime with that count lands the pages a step reads at once on a share of
the memory channels. Measured on an H100 (export/results/README.md, "Frame strides that camp"): a sliding layer's
decode at batch 256 read its pages 24 % slower at every frame stride that is a multiple of 1,280 KiB (the 31B's
12.5 MiB frame among them) and at the packed speed at every other stride tried, 16 and 32 KiB past 12.5 MiB as
fast as 128 KiB past it (8 KiB past it 1.4 % slower on one of two cards); the padding costs the 31B 0.25 % of its
frames. Engines built with other frames (unpadded, or in other granules) are refused by their manifest's
`geometry.frame_elems`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import Gemma4Config

# The dtypes weights, activations and the KV arena may have, by the names configs and manifests use.
# The one table of them; sizes come from `torch.dtype.itemsize`.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV arena may also hold 1-byte floats (`kv_dtype`): half the bytes a decode reads and twice the positions a
# frame holds. K and V are stored as the model's rows rounded to the nearest value, saturated at the format's
# largest (plugins/reference.py `to_kv`), with no scale: Gemma 4 norms both (`k_norm`, `v_norm`), so their
# entries sit well inside e4m3's range.
KV_DTYPES = {**DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}
PAGE_TOKENS = 16  # positions per sliding page: the runtime's default
ALIGN = 16  # full-group pages are a multiple of this many positions (kernel tiles never straddle one)
FRAME_GRANULES = 512  # a frame is padded in steps of about 1/512 of it (frame_stride; module docstring)
MIN_GRANULE = 16  # elements: every frame's row stays a multiple of 16, as the kernels' vector loads assume best
CAMPING_PRIMES = (3, 5)  # the odd primes of GPUs' memory stack counts, kept out of a frame's granule count


def frame_stride(elems: int) -> int:
    """Elements a frame of at least `elems` takes in the arena: the fewest granules (the largest power of two at
    most 1/FRAME_GRANULES of `elems`, and at least MIN_GRANULE) at least as large whose count, halved while even, no
    prime of CAMPING_PRIMES divides. Arena dtypes are powers of two bytes, so the frame's bytes have the same odd
    factor."""
    granule = max(MIN_GRANULE, 1 << max(0, (elems // FRAME_GRANULES).bit_length() - 1))
    n = -(-elems // granule)
    while any(_odd_part(n) % p == 0 for p in CAMPING_PRIMES):
        n += 1
    return n * granule


def _odd_part(n: int) -> int:
    return n // (n & -n)


def torch_dtype(dtype: "str | torch.dtype", kv: bool = False) -> torch.dtype:
    """A dtype name ("bfloat16") or torch dtype -> the torch dtype; unknown names are an error naming them.
    `kv`: a KV arena's dtype, which may also be one of KV_DTYPES' 1-byte floats."""
    table = KV_DTYPES if kv else DTYPES
    what = "KV dtype" if kv else "dtype"
    if isinstance(dtype, torch.dtype):
        if dtype not in table.values():
            raise ValueError(f"{what} {dtype} is not supported; use one of {', '.join(table)}")
        return dtype
    if dtype not in table:
        raise ValueError(f"{what} {dtype!r} is not one of {', '.join(table)}")
    return table[dtype]


def dtype_name(dtype: "str | torch.dtype", kv: bool = False) -> str:
    """The name configs and manifests use for `dtype` ("bfloat16"); `kv` as torch_dtype takes it."""
    return str(torch_dtype(dtype, kv)).removeprefix("torch.")


@dataclass(frozen=True)
class LayerKV:
    index: int
    sliding: bool
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    window: int | None  # W keys including the current one; None on full layers
    k_eq_v: bool
    source: int  # layer whose cache this layer reads (== index when it owns one)

    @property
    def owns_cache(self) -> bool:
        return self.source == self.index

    @property
    def group(self) -> str:
        return "sliding" if self.sliding else "full"


@dataclass(frozen=True)
class CacheGroup:
    name: str  # "sliding" | "full"
    layers: tuple[int, ...]  # cache-owning layers of this group, in model order
    head_dim: int
    num_kv_heads: int
    window: int | None
    dtype_bytes: int

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    @property
    def bytes_per_token(self) -> int:
        return len(self.layers) * self.bytes_per_token_per_layer

    def resident_positions(self, context: int, chunk: int = 1) -> int:
        """Positions this group must hold for one request at `context` while computing `chunk` tokens."""
        if self.window is None:
            return context
        return min(context, self.window - 1 + chunk)


@dataclass(frozen=True)
class KVLayout:
    config: Gemma4Config
    layers: tuple[LayerKV, ...]
    sliding: CacheGroup
    full: CacheGroup
    dtype: str  # the KV dtype's name

    @classmethod
    def from_config(cls, cfg: Gemma4Config, dtype: "str | torch.dtype | None" = None) -> "KVLayout":
        """The layout of `cfg` with KV in `dtype` (default: the config's dtype; any of KV_DTYPES)."""
        dtype = dtype_name(dtype or cfg.dtype, kv=True)
        nbytes = torch_dtype(dtype, kv=True).itemsize
        layers = tuple(
            LayerKV(
                index=i,
                sliding=cfg.is_sliding(i),
                head_dim=cfg.layer_head_dim(i),
                num_q_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.layer_kv_heads(i),
                window=cfg.sliding_window if cfg.is_sliding(i) else None,
                k_eq_v=cfg.layer_k_eq_v(i),
                source=cfg.kv_source(i),
            )
            for i in range(cfg.num_hidden_layers)
        )

        def group(sliding: bool) -> CacheGroup:
            owners = tuple(l.index for l in layers if l.sliding == sliding and l.owns_cache)
            heads = {layers[i].num_kv_heads for i in owners} or {0}
            assert len(heads) == 1, "a cache group must have one KV head count"
            return CacheGroup(
                name="sliding" if sliding else "full",
                layers=owners,
                head_dim=cfg.head_dim if sliding else cfg.global_head_dim,
                num_kv_heads=heads.pop(),
                window=cfg.sliding_window if sliding else None,
                dtype_bytes=nbytes,
            )

        return cls(cfg, layers, group(True), group(False), dtype)

    @property
    def groups(self) -> tuple[CacheGroup, CacheGroup]:
        return (self.sliding, self.full)

    @property
    def bytes_per_token(self) -> int:
        return self.sliding.bytes_per_token + self.full.bytes_per_token

    def request_bytes(self, context: int, *, keep_all: bool, chunk: int = 1) -> int:
        """KV bytes of one request at `context` positions: every position in every owning layer
        (`keep_all`), or the sliding group holding only its window (W-1 old positions + the chunk)."""
        if keep_all:
            return self.bytes_per_token * context
        return (self.sliding.bytes_per_token * self.sliding.resident_positions(context, chunk)
                + self.full.bytes_per_token * context)


@dataclass(frozen=True)
class PageGeometry:
    """How both groups' pages sit in the arena's frames. Offsets are in elements of the arena dtype."""

    layout: KVLayout
    page_tokens: dict  # group name -> positions per page
    frame_elems: int
    offsets: dict  # layer index (owning) -> (k_offset, v_offset) inside a frame

    @classmethod
    def build(cls, layout: KVLayout, page_tokens: int = PAGE_TOKENS, align: int = ALIGN) -> "PageGeometry":
        """The one constructor: `PageGeometry.build(KVLayout.from_config(cfg, dtype), page_tokens)`, or
        `PageGeometry.build(model.layout, page_tokens)` for a model in memory (its layout has its dtype)."""
        for name, value in (("page_tokens", page_tokens), ("align", align)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        align = min(align, page_tokens)
        s, f = layout.sliding, layout.full
        elems = {g.name: g.bytes_per_token // g.dtype_bytes for g in (s, f)}  # per position, all layers
        tokens = {}
        if elems["sliding"] and elems["full"]:
            tokens["sliding"] = page_tokens
            fit = page_tokens * elems["sliding"] // elems["full"]
            tokens["full"] = max(align, fit // align * align)
        else:
            for name in elems:
                tokens[name] = page_tokens
        frame = frame_stride(max(tokens[n] * elems[n] for n in elems))
        offsets = {}
        for g in (s, f):
            block = tokens[g.name] * g.num_kv_heads * g.head_dim
            for j, layer in enumerate(g.layers):
                offsets[layer] = (2 * j * block, (2 * j + 1) * block)
        return cls(layout, tokens, frame, offsets)

    def frame_bytes(self) -> int:
        return self.frame_elems * self.layout.sliding.dtype_bytes

    def pages_for(self, group: str, positions: int) -> int:
        return math.ceil(positions / self.page_tokens[group]) if positions > 0 else 0

    def layer_offsets(self, layer: int) -> tuple[int, int]:
        """(k_offset, v_offset) of the cache that `layer` reads (its own or its KV source's)."""
        return self.offsets[self.layout.layers[layer].source]

    def sliding_pages_per_request(self, chunk: int) -> int:
        """Most sliding pages one request holds while it computes a chunk of `chunk` tokens: the
        window's W-1 old positions plus the chunk, which need not start on a page boundary (+1)."""
        w = self.layout.sliding.window
        if w is None or not self.layout.sliding.layers:
            return 0
        return math.ceil((w - 1 + chunk) / self.page_tokens["sliding"]) + 1
