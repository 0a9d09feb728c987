"""Capacity planning: weights, KV bytes and how many requests fit, for `g4rt plan`.

Every KV number comes from `models/layout.py` (KVLayout, PageGeometry) and admission.py's promise;
the only thing derived here is the parameter count, from the config in one function
(`parameter_counts`, module shapes of gemma4-spec.md §5).
"""
from __future__ import annotations

from dataclasses import dataclass

from g4rt.models.config import Gemma4Config
from g4rt.models.layout import PAGE_TOKENS, KVLayout, PageGeometry, torch_dtype

from .admission import promise_for

GIB = 1 << 30


@dataclass(frozen=True)
class ParameterCounts:
    embed: int  # token embedding (tied with lm_head)
    ple_table: int  # per-layer-embedding table (E2B/E4B)
    ple_proj: int  # per-layer model projection + its norm
    layers: int  # decoder layers: attention, MLP/MoE, norms, layer_scalar, PLE gate/proj
    final_norm: int
    unused_shared_kv: int  # k_proj/v_proj/k_norm stored on KV-shared layers but never read

    @property
    def total(self) -> int:
        """Everything the checkpoint stores (the text decoder)."""
        return self.embed + self.ple_table + self.ple_proj + self.layers + self.final_norm

    @property
    def used(self) -> int:
        return self.total - self.unused_shared_kv


def parameter_counts(cfg: Gemma4Config) -> ParameterCounts:
    """Text-decoder parameter counts from the config alone (checkpoint shapes, spec §5)."""
    H, P, L = cfg.hidden_size, cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    layers = unused = 0
    for i in range(L):
        hd, kv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        kv_proj = H * kv * hd * (1 if cfg.layer_k_eq_v(i) else 2) + hd  # k (and v) proj, k_norm
        attn = 2 * H * cfg.num_attention_heads * hd + hd + kv_proj  # q, o, q_norm
        if cfg.kv_source(i) != i:
            unused += kv_proj
        n = attn + 3 * H * cfg.layer_intermediate(i) + 4 * H + 1
        if cfg.has_ple:
            n += 2 * H * P + H
        if cfg.enable_moe_block:
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            n += H * E + H + E + E * 3 * H * I + 3 * H  # router, experts, three extra norms
        layers += n
    ple_table = cfg.vocab_size_per_layer_input * L * P if cfg.has_ple else 0
    ple_proj = L * P * H + P if cfg.has_ple else 0
    return ParameterCounts(cfg.vocab_size * H, ple_table, ple_proj, layers, H, unused)


@dataclass(frozen=True)
class Plan:
    name: str
    dtype: str  # the weights'; the KV's is the layout's
    layout: KVLayout
    geometry: PageGeometry
    params: ParameterCounts
    context: int
    chunk: int
    memory_bytes: int | None

    @property
    def weight_bytes(self) -> int:
        return self.params.total * torch_dtype(self.dtype).itemsize

    def request_bytes(self, keep_all: bool) -> int:
        return self.layout.request_bytes(self.context, keep_all=keep_all, chunk=1 if keep_all else self.chunk)

    @property
    def request_frames(self) -> int:
        """Frames admission promises one request at `context` (prompt = context - 1, one new token)."""
        return promise_for(self.geometry, self.context - 1, 1, self.chunk).frames

    @property
    def kv_budget_bytes(self) -> int | None:
        return None if self.memory_bytes is None else max(0, self.memory_bytes - self.weight_bytes)

    @property
    def frames_in_budget(self) -> int | None:
        b = self.kv_budget_bytes
        return None if b is None else b // self.geometry.frame_bytes()

    @property
    def requests_fit(self) -> int | None:
        f = self.frames_in_budget
        return None if f is None else f // self.request_frames

    def as_dict(self) -> dict:
        s, f = self.layout.sliding, self.layout.full
        return {
            "model": self.name, "dtype": self.dtype, "kv_dtype": self.layout.dtype, "context": self.context,
            "chunk": self.chunk,
            "parameters": self.params.total, "parameters_used": self.params.used,
            "weight_bytes": self.weight_bytes,
            "sliding": {"layers": len(s.layers), "window": s.window, "bytes_per_token": s.bytes_per_token,
                        "page_tokens": self.geometry.page_tokens["sliding"]},
            "full": {"layers": len(f.layers), "bytes_per_token": f.bytes_per_token,
                     "page_tokens": self.geometry.page_tokens["full"]},
            "bytes_per_token": self.layout.bytes_per_token,
            "request_bytes_all_positions": self.request_bytes(keep_all=True),
            "request_bytes_sliding_window": self.request_bytes(keep_all=False),
            "frame_bytes": self.geometry.frame_bytes(),
            "request_frames": self.request_frames,
            "memory_bytes": self.memory_bytes, "kv_budget_bytes": self.kv_budget_bytes,
            "frames_in_budget": self.frames_in_budget, "requests_fit": self.requests_fit,
        }


def make_plan(name: str, cfg: Gemma4Config, *, context: int, chunk: int = 1,
              page_tokens: int = PAGE_TOKENS, dtype: str | None = None, kv_dtype: str | None = None,
              memory_bytes: int | None = None) -> Plan:
    """The plan of `cfg` with weights in `dtype` and KV in `kv_dtype` (defaults: the config's, `dtype`)."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    dtype = dtype or cfg.dtype
    layout = KVLayout.from_config(cfg, kv_dtype or dtype)
    return Plan(name, dtype, layout, PageGeometry.build(layout, page_tokens), parameter_counts(cfg),
                context, chunk, memory_bytes)


def format_plan(p: Plan) -> str:
    d = p.as_dict()
    lines = [
        f"{p.name}  ({p.dtype}{'' if p.layout.dtype == p.dtype else f', KV {p.layout.dtype}'}; "
        f"{d['parameters']:,} parameters = {d['weight_bytes'] / GIB:.2f} GiB of weights)",
        f"  sliding group: {d['sliding']['layers']} layers, window {d['sliding']['window']}, "
        f"{d['sliding']['bytes_per_token']:,} B/token, {d['sliding']['page_tokens']} positions/page",
        f"  full group:    {d['full']['layers']} layers, {d['full']['bytes_per_token']:,} B/token, "
        f"{d['full']['page_tokens']} positions/page",
        f"  total {d['bytes_per_token']:,} B/token; frame {d['frame_bytes']:,} B",
        f"  one request at {p.context:,} positions: every position kept {d['request_bytes_all_positions']:,} B "
        f"({d['request_bytes_all_positions'] / GIB:.2f} GiB); sliding keeps W-1+{p.chunk} "
        f"{d['request_bytes_sliding_window']:,} B ({d['request_bytes_sliding_window'] / GIB:.2f} GiB); "
        f"admission promises {d['request_frames']:,} frames",
    ]
    if p.memory_bytes is not None:
        lines.append(f"  in {p.memory_bytes / GIB:.1f} GiB: {d['kv_budget_bytes'] / GIB:.2f} GiB after weights = "
                     f"{d['frames_in_budget']:,} frames -> {d['requests_fit']:,} requests at this context")
    return "\n".join(lines)
