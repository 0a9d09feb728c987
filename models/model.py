"""The Gemma 4 text decoder as one plain torch module (gpt-fast style).

Semantics follow Hugging Face's `Gemma4ForCausalLM` (transformers 5.24; the research notes'
gemma4-spec.md) exactly, including its dtype behaviour: the residual stream
stays in the model dtype, norms compute in fp32 and cast back, RoPE cos/sin are cast to the model
dtype before they are applied, and the final softcap runs in the model dtype.

Differences in *shape* from HF, on purpose:

* The token axis is flat and varlen: `forward(token_ids [T], positions [T], attention)`. Batching,
  caches and masks live outside the model, in the `attention` callable.
* Attention is pluggable. Each layer computes q (normed, roped) and, when it owns a cache, k
  (normed, roped) and v (v_norm'ed), then calls `attention(layer: LayerKV, q, k, v) -> o`. KV-shared
  layers pass `k = v = None`; the callable reads the cache of `layer.source`. A layer whose q/k/v come from
  one packed weight (`Attention.input_weight`) hands a callable with a `from_projection(attn, y, cos, sin) -> o`
  method the projection y before its norms and RoPE instead (`attend`): the paged step's Triton kernels norm,
  rope, write and attend a decode step in one launch.

Parameter names equal HF's checkpoint names with the `model.` prefix removed (`embed_tokens.weight`,
`layers.3.self_attn.q_proj.weight`, `layers.3.experts.gate_up_proj`, `layers.3.layer_scalar`, ...), so
a checkpoint's state dict loads directly (see `checkpoint.py`). KV-shared layers have no
k_proj/v_proj/k_norm (their checkpoint copies are dead weights, spec §2.4).

Construct with the final dtype and device (`Gemma4Model(cfg, dtype=..., device=...)`) instead of
calling `.to(dtype)` afterwards: the RoPE inverse frequencies are fp32 buffers and must stay fp32.

Kernels: every module that runs an elementwise block or a plugin op reads its `kernels` attribute
("triton" or "reference", plugins/ops.py); `Gemma4Model(kernels=...)` or `model.set_kernels(...)`
sets it on all of them at once (default: Triton on CUDA, the reference elsewhere).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..plugins.ops import check_kernels, default_kernels
from .blocks import apply_rope, block
from .config import Gemma4Config
from .layout import KVLayout, LayerKV

# attention(layer, q [T,Hq,D], k [T,Hkv,D] | None, v [T,Hkv,D] | None) -> o [T,Hq,D]; optionally with
# attention.from_projection(attn: Attention, y [T, packed q/k/v], cos, sin) -> o (see `attend`)
AttentionFn = Callable[[LayerKV, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]], torch.Tensor]


def attend(attention: AttentionFn, attn: "Attention", qkv, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """o of `attention` for a layer's q/k/v as `Attention.project` gives them: (q, k, v), or the packed projection
    y, which a callable with `from_projection` takes as it is, and any other after the layer's norms and RoPE."""
    if isinstance(qkv, tuple):
        return attention(attn.kv, *qkv)
    take = getattr(attention, "from_projection", None)
    if take is not None:
        return take(attn, qkv, cos, sin)
    return attention(attn.kv, *attn.from_projection(qkv, cos, sin))


class RMSNorm(nn.Module):
    """Gemma 4 RMSNorm (`blocks.rms_norm`): fp32 math, times the plain `weight`, cast back.
    `with_scale=False` (v_norm) has no weight at all."""

    kernels = "reference"

    def __init__(self, dim: int, eps: float, with_scale: bool = True, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block("rms_norm", self.kernels, x, self.weight, self.eps)


class Linear(nn.Linear):
    """A bias-free projection whose matmul is the op `skinny_linear`: with the Triton kernels, at one row on a
    Hopper GPU a small weight's Gluon kernel (its slices copied into shared memory before the launch waits,
    plugins/gluon_gemv.py), else the skinny matmul for a decode's few rows (plugins/triton_gemv.py), else
    cuBLAS or cuBLASLt (`blas_linear`); F.linear with the reference.
    Its input is [T, in_features], the model's flat token axis (the op's shapes are 2-D)."""

    kernels = "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block("skinny_linear", self.kernels, x, self.weight)


def _linear(n_in: int, n_out: int, dtype, device) -> Linear:
    return Linear(n_in, n_out, bias=False, dtype=dtype, device=device)


def _pack(parts: list[nn.Linear]) -> torch.Tensor:
    """The weights of `parts` concatenated (output rows in order), each Linear's weight becoming a view
    of it: the state dict keeps its names and values, and one matmul computes all the outputs."""
    with torch.no_grad():
        packed = torch.cat([m.weight for m in parts])
    row = 0
    for m in parts:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(packed[row:row + n], requires_grad=False)
        row += n
    return packed


def rope_inv_freq(cfg: Gemma4Config, sliding: bool) -> torch.Tensor:
    """fp32 inverse frequencies, length head_dim/2 of the layer type.

    Sliding layers: default RoPE over the whole 256-dim head. Full layers: "proportional" RoPE: only
    the first `partial * global_head_dim / 2` frequencies are non-zero, with exponent denominator
    global_head_dim (not the rotated width); the rest are 0, so those dims pass through unchanged.
    """
    if sliding:
        dim = cfg.head_dim
        return 1.0 / (cfg.rope_local_base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    dim = cfg.global_head_dim
    angles = int(cfg.rope_global_partial_factor * dim // 2)
    rotated = 1.0 / (cfg.rope_global_base ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / dim))
    return torch.cat([rotated, torch.zeros(dim // 2 - angles, dtype=torch.float)])


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin [T, D] computed in fp32, then cast to the model dtype (HF applies RoPE in that dtype)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    kernels = "reference"

    def __init__(self, cfg: Gemma4Config, kv: LayerKV, dtype, device):
        super().__init__()
        self.kv = kv
        H, D = cfg.hidden_size, kv.head_dim
        self.head_dim = D
        self.q_proj = _linear(H, kv.num_q_heads * D, dtype, device)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.k_proj = self.v_proj = None  # KV-shared layers read their source's cache
        if kv.owns_cache:
            self.k_proj = _linear(H, kv.num_kv_heads * D, dtype, device)
            # k_eq_v (26B/31B full layers): no v_proj; V is v_norm of the *raw* k_proj output.
            self.v_proj = None if kv.k_eq_v else _linear(H, kv.num_kv_heads * D, dtype, device)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.v_norm = RMSNorm(D, cfg.rms_norm_eps, with_scale=False)
        self.o_proj = _linear(kv.num_q_heads * D, H, dtype, device)
        self.qkv_weight: torch.Tensor | None = None  # see pack_qkv

    def pack_qkv(self) -> None:
        """Hold q, k and v as one weight, the three Linear weights becoming views of it, so a step reads
        them with one matmul: cuBLAS reads the narrow k and v projections well below the copy bandwidth it
        reaches on a wide weight (export/results/README.md, the 31B's matmul roles). The packed weight is a
        plain attribute, not a parameter (state-dict names stay HF's; export never packs), so pack once the
        model is on its device: `checkpoint.load_model` / `random_model` do it on CUDA."""
        parts = [m for m in (self.q_proj, self.k_proj, self.v_proj) if m is not None]
        if len(parts) >= 2 and self.qkv_weight is None:
            self.qkv_weight = _pack(parts)

    def input_weight(self) -> torch.Tensor | None:
        """The one weight the layer's input goes through first: the packed q/k/v, or a KV-shared layer's q_proj;
        None where q, k and v are separate (not packed: export, CPU models)."""
        if self.qkv_weight is not None:
            return self.qkv_weight
        return self.q_proj.weight if self.k_proj is None else None

    def from_projection(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q, k, v) of the input's projection y by `input_weight()`: the norms and RoPE."""
        if self.qkv_weight is not None:  # norms and RoPE of all three in one block
            return block("qkv_norm_rope", self.kernels, y, self.q_norm.weight,
                         self.k_norm.weight, self.q_norm.eps, cos, sin, self.kv.num_q_heads, self.kv.num_kv_heads,
                         self.v_proj is None)
        # a KV-shared layer: q's norm and RoPE, one block
        return block("q_norm_rope", self.kernels, y, self.q_norm.weight, self.q_norm.eps, cos, sin), None, None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The projection y of x by `input_weight()` where the layer has one (its norms and RoPE are
        `from_projection`'s, or the attention callable's: `attend`); else the tuple of normed, roped q, and k (normed,
        roped) and v (v_norm'ed) where the layer owns a cache, else None."""
        T, D = x.shape[0], self.head_dim
        w = self.input_weight()
        if w is not None:  # one matmul
            return block("skinny_linear", self.kernels, x, w)
        q = apply_rope(self.q_norm(self.q_proj(x).view(T, -1, D)), cos, sin)
        k_raw = self.k_proj(x).view(T, -1, D)
        # k_eq_v: V is v_norm of the raw k_proj output.
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).view(T, -1, D)
        return q, apply_rope(self.k_norm(k_raw), cos, sin), self.v_norm(v_raw)


class MLP(nn.Module):
    kernels = "reference"

    def __init__(self, hidden: int, inter: int, dtype, device):
        super().__init__()
        self.gate_proj = _linear(hidden, inter, dtype, device)
        self.up_proj = _linear(hidden, inter, dtype, device)
        self.down_proj = _linear(inter, hidden, dtype, device)
        self.gate_up_weight: torch.Tensor | None = None  # see pack_gate_up

    def pack_gate_up(self) -> None:
        """Hold gate and up as one weight, as `Attention.pack_qkv` does q/k/v: one matmul reads both, and
        forms the gated GELU of its two halves (`gelu_linear`: in the skinny matmul's epilogue, at decode)."""
        if self.gate_up_weight is None:
            self.gate_up_weight = _pack([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            act = block("gelu_linear", self.kernels, x, self.gate_up_weight, None)
        else:
            act = block("gelu_tanh_mul", self.kernels, self.gate_proj(x), self.up_proj(x))
        return self.down_proj(act)

    def after_residual_step(self, residual, x, x_weight, norm_weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, the MLP of norm(h) * norm_weight) for the post-norm residual step h = residual + norm(x) *
        x_weight. With gate/up packed, the step and the norm are one block with the gate/up projection
        (`add_norm_gelu_linear`: at decode the skinny matmul's prologue, no launch of their own)."""
        if self.gate_up_weight is None:
            h, x = block("add_rms_norm", self.kernels, residual, x, x_weight, norm_weight, eps)
            return h, self(x)
        h, act = block("add_norm_gelu_linear", self.kernels, residual, x, x_weight, norm_weight, eps,
                       self.gate_up_weight, None)
        return h, self.down_proj(act)


class Router(nn.Module):
    """Softmax (fp32, as HF 5.24) over all experts, then top-k, renormalise, times per_expert_scale.

    Its input is HF's router input, norm(h) * scale * root (an unweighted norm of the residual, the
    router's scale vector, 1/sqrt(H)): the layer computes it in one block with the experts' input norm
    (`blocks.router_inputs`), so `forward` starts at the projection.

    With the Triton kernels (CUDA) `blocks.route` runs as the opaque op `g4rt::route`, one kernel
    (plugins/triton_moe.py) in the eager and the compiled engine alike: Inductor would sum the softmax and
    the renormalisation in its own order, and a weight one fp32 ulp apart can flip a bf16 bit of the
    experts' sum. With the reference (CPU, torch.export) it is plain torch, so the ONNX graph has Softmax
    and TopK."""

    kernels = "reference"

    def __init__(self, cfg: Gemma4Config, dtype, device):
        super().__init__()
        H, E = cfg.hidden_size, cfg.num_experts
        self.top_k = cfg.top_k_experts
        self.root = H ** -0.5
        self.proj = _linear(H, E, dtype, device)
        self.scale = nn.Parameter(torch.ones(H, dtype=dtype, device=device))
        self.per_expert_scale = nn.Parameter(torch.ones(E, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return block("route", self.kernels, self.proj(x), self.per_expert_scale, self.top_k)


class Experts(nn.Module):
    """Fused expert weights: gate_up_proj [E, 2I, H] (rows [0:I] gate, [I:2I] up), down_proj [E, H, I],
    run by the plugin op `g4rt::moe` (plugins/README.md): HF's eager experts arithmetic (ascending expert
    ids, weighted outputs added into a model-dtype accumulator; not its default grouped_mm, whose order
    differs). One opaque node for torch.compile and the ONNX export (`gemma4::G4MoE`); the Triton kernels
    read only the experts some token chose."""

    kernels = "reference"

    def __init__(self, cfg: Gemma4Config, dtype, device):
        super().__init__()
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(E, H, I, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.g4rt.moe(x, idx, w, self.gate_up_proj, self.down_proj, self.kernels)


class DecoderLayer(nn.Module):
    kernels = "reference"

    def __init__(self, cfg: Gemma4Config, kv: LayerKV, dtype, device):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps

        def norm(dim=H):
            return RMSNorm(dim, eps, dtype=dtype, device=device)

        self.self_attn = Attention(cfg, kv, dtype, device)
        self.mlp = MLP(H, cfg.layer_intermediate(kv.index), dtype, device)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        # Persistent: read from the checkpoint (JAX skip_scale); scales the whole residual stream.
        self.register_buffer("layer_scalar", torch.ones(1, dtype=dtype, device=device))
        self.has_ple = cfg.has_ple
        if self.has_ple:
            P = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = _linear(H, P, dtype, device)
            self.per_layer_projection = _linear(P, H, dtype, device)
            self.post_per_layer_input_norm = norm()
        self.has_moe = cfg.enable_moe_block
        if self.has_moe:
            self.router = Router(cfg, dtype, device)
            self.experts = Experts(cfg, dtype, device)
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
            self.pre_feedforward_layernorm_2 = norm()

    def forward(self, h, m, tail, cos, sin, attention: AttentionFn, ple: torch.Tensor | None):
        """The residual stream entering the layer is h with the layer before's last residual step pending: h +
        norm(m) * tail[0], times tail[1] (the layer before's `tail()`); for the first layer m and tail are None
        and h is the stream. Returns the stream leaving the layer in that form, (h, m): the pending step, this
        layer's input norm and its first projection are one block (`attention_inputs`), and after the last layer
        the model forms the step with the final norm."""
        h, qkv = self.attention_inputs(h, m, tail, cos, sin)
        return self.after_attention(h, attend(attention, self.self_attn, qkv, cos, sin), ple)

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm weight, layer scalar) of the residual step that ends this layer, formed by the next one."""
        post = self.post_per_layer_input_norm if self.has_ple else self.post_feedforward_layernorm
        return post.weight, self.layer_scalar

    # The layer in two pieces around the attention call. The inductor engine compiles each piece once for
    # all layers of a kind: neither reads the layer's index (the attention call does, for its cache
    # offsets), and the layer before's tail weights are arguments, so layers of one shape share one compiled graph.
    def attention_inputs(self, h, m, tail, cos, sin):
        """The stream h (the pending step formed, see forward), and the layer's q/k/v as `Attention.project` gives
        them (the packed projection, or the tuple)."""
        attn, norm = self.self_attn, self.input_layernorm
        if m is None:
            return h, attn.project(norm(h), cos, sin)
        w = attn.input_weight()
        if w is None:
            h, x = block("add_rms_norm", self.kernels, h, m, tail[0], norm.weight, norm.eps, tail[1])
            return h, attn.project(x, cos, sin)
        return block("add_norm_linear", self.kernels, h, m, tail[0], norm.weight, norm.eps, tail[1], w)

    def after_attention(self, h, o, ple):
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        eps = post.eps
        # h = residual + post(o_proj(o)), a post-norm residual step, and the MLP of its pre-norm pre(h).
        h, m = self.mlp.after_residual_step(h, self.self_attn.o_proj(o.reshape(o.shape[0], -1)), post.weight,
                                            pre.weight, eps)
        if self.has_moe:
            # The dense MLP is the shared expert; router and experts read the un-normed residual, each through
            # its own norm (one block), and the two branches' post-norms and sum are one block.
            r, e = block("router_inputs", self.kernels, h, self.router.scale, self.router.root,
                         self.pre_feedforward_layernorm_2.weight, eps)
            w, idx = self.router(r)
            m = block("normed_sum", self.kernels, m, self.post_feedforward_layernorm_1.weight, self.experts(e, idx, w),
                      self.post_feedforward_layernorm_2.weight, eps)
        if self.has_ple:  # h + post(m), and the PLE gate's GELU of it: one block
            h, g = block("add_norm_gelu_linear", self.kernels, h, m, self.post_feedforward_layernorm.weight, None, eps,
                         self.per_layer_input_gate.weight, ple)
            m = self.per_layer_projection(g)
        # The tail, h + post(m) times layer_scalar (post and the scalar are `tail()`), is the next layer's to form.
        return h, m


def _round_to(x: float, dtype: torch.dtype) -> float:
    """x rounded to `dtype`, as a Python float (exact: every bf16/fp16/fp32 value is a double)."""
    return torch.tensor(x, dtype=dtype).item()


class Gemma4Model(nn.Module):
    """The text decoder. `forward` -> final-normed hidden [T, H]; `logits(hidden rows)` -> fp32 logits."""

    kernels = "reference"

    def __init__(self, cfg: Gemma4Config, dtype: torch.dtype = torch.bfloat16, device=None,
                 kernels: str | None = None, kv_dtype: "str | torch.dtype | None" = None):
        super().__init__()
        self.config = cfg
        # The KV arena holds `kv_dtype` (layout.KV_DTYPES; default the model's dtype): every arena, cache and
        # roofline built for this model reads it here.
        self.layout = KVLayout.from_config(cfg, kv_dtype or dtype)
        self.dtype = dtype
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kv, dtype, device) for kv in self.layout.layers)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype, device=device)
        if cfg.has_ple:
            L, P = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, L * P, dtype=dtype, device=device)
            self.per_layer_model_projection = _linear(H, L * P, dtype, device)
            self.per_layer_projection_norm = RMSNorm(P, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.register_buffer("sliding_inv_freq", torch.empty(cfg.head_dim // 2, device=device), persistent=False)
        self.register_buffer("full_inv_freq", torch.empty(cfg.global_head_dim // 2, device=device), persistent=False)
        self.reset_rope()
        self.set_kernels(kernels or default_kernels(device or "cpu"))

    def set_kernels(self, kernels: str) -> "Gemma4Model":
        """Run every elementwise block and plugin op of this model with `kernels` ("triton"|"reference")."""
        check_kernels(kernels)
        for m in self.modules():
            if hasattr(m, "kernels"):
                m.kernels = kernels
        return self

    def reset_rope(self) -> None:
        """(Re)compute the fp32 RoPE tables; the checkpoint loader calls this after `to_empty`."""
        if self.sliding_inv_freq.is_meta:
            return
        with torch.no_grad():
            self.sliding_inv_freq.copy_(rope_inv_freq(self.config, sliding=True))
            self.full_inv_freq.copy_(rope_inv_freq(self.config, sliding=False))

    def pack_weights(self) -> None:
        """Every cache-owning layer's q/k/v as one weight (Attention.pack_qkv), every dense MLP's gate and
        up as one (MLP.pack_gate_up). Plain attributes, not parameters: pack once the model is on its
        device (`checkpoint.load_model` / `random_model` do on CUDA); export never packs."""
        for layer in self.layers:
            layer.self_attn.pack_qkv()
            layer.mlp.pack_gate_up()

    def _scaled_embed(self, table: nn.Embedding, ids: torch.Tensor, scale: float) -> torch.Tensor:
        # HF rounds the scale to the model dtype before the multiply (sqrt(1536) -> 39.25 in bf16). Done
        # on the host: a tensor made here would be a host-to-device copy inside CUDA-graph capture.
        return table(ids) * _round_to(scale, table.weight.dtype)

    def _per_layer_inputs(self, ids: torch.Tensor, h_embed: torch.Tensor) -> torch.Tensor:
        """PLE [T, L, P]: (norm(proj(h_embed) / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)."""
        cfg = self.config
        T, L, P = ids.shape[0], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        tok = self._scaled_embed(self.embed_tokens_per_layer, ids, P ** 0.5).view(T, L, P)
        proj = self.per_layer_model_projection(h_embed) * cfg.hidden_size ** -0.5
        proj = self.per_layer_projection_norm(proj.view(T, L, P))
        return (proj + tok) * 2.0 ** -0.5

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """token_ids, positions: int [T] (flat varlen batch) -> hidden [T, H] after the final norm (HF's
        last_hidden_state), which the last layer's tail computes for every row in the same launch."""
        cfg = self.config
        ids = token_ids.long()
        h = self._scaled_embed(self.embed_tokens, ids, cfg.hidden_size ** 0.5)
        ple = self._per_layer_inputs(ids, h) if cfg.has_ple else None
        rope = {
            True: rope_cos_sin(self.sliding_inv_freq, positions, h.dtype),
            False: rope_cos_sin(self.full_inv_freq, positions, h.dtype),
        }
        m = tail = None
        for i, layer in enumerate(self.layers):
            cos, sin = rope[layer.self_attn.kv.sliding]
            h, m = layer(h, m, tail, cos, sin, attention, ple[:, i] if ple is not None else None)
            tail = layer.tail()
        # the last layer's tail and the final norm, one block
        return block("add_rms_norm", self.kernels, h, m, tail[0], self.norm.weight, self.norm.eps, tail[1])[1]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """final-normed hidden rows [R, H] -> fp32 logits [R, vocab]: tied lm_head, softcap in model dtype;
        written into `out` where given (the buffer the inductor engine's decode graphs share) and returned."""
        x = block("skinny_linear", self.kernels, hidden, self.embed_tokens.weight)
        cap = self.config.final_logit_softcapping
        if out is None:
            return block("softcap_logits", self.kernels, x, cap)
        block("softcap_logits_", self.kernels, x, cap, out)
        return out
