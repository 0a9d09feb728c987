"""The decoder's elementwise math: torch references, and their Triton kernels where the model runs them.

`rms_norm`, `gelu_tanh_mul`, `apply_rope`, the fused blocks built from them (`qkv_norm_rope`,
`q_norm_rope`, `add_rms_norm` (the residual step `add_normed`, then a norm), and for the MoE block
`router_inputs` and `normed_sum`) and the MoE router's `route` are written as Hugging Face writes them;
`skinny_linear` is F.linear, every projection's matmul, which a Triton kernel runs for a decode's few rows
(plugins/triton_gemv.py), and `gelu_linear` the gated GELU of one (the MLP's packed gate/up, the PLE gate),
which that kernel forms in its epilogue; `add_norm_gelu_linear` a residual step and the gated GELU of a
projection of it, whose norms the kernel forms in its prologue; `add_norm_linear` a layer's tail and the next
layer's first projection (one launch at batch 1 on Hopper, plugins/gluon_gemv.py); `softcap_logits` the
logits' softcap and their cast to fp32 (`softcap_logits_` into a buffer the caller owns).
`block(name, kernels, *args)` runs one of them: with `kernels == "triton"` as the opaque custom op
`g4rt::<name>` (plugins/triton_norm.py, triton_moe.py, triton_gemv.py), which the eager and the compiled
engine both call, so they compute the same bits; with `"reference"` as the plain torch code below
(what torch.export traces on CPU, so the ONNX graph has no custom node for them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def block(name: str, kernels: str, *args):
    """Elementwise block `name` through the kernels the model was configured with."""
    if kernels == "triton":
        from g4rt.plugins import triton_gemv, triton_moe, triton_norm  # noqa: F401  (register torch.ops.g4rt.<name>)
        return getattr(torch.ops.g4rt, name)(*args)
    return REFERENCE[name](*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm over the last dim: fp32 math, times the plain `weight` (not 1 + weight; None
    for v_norm and the router's norm), cast back to x's dtype."""
    x32 = x.float()
    # torch.pow(..., -0.5) rather than rsqrt, as HF does, so the fp32 results agree bit for bit.
    y = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of every Gemma 4 MLP, expert and PLE gate: gelu_tanh(gate) * up."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_linear(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh_mul of a projection: of the two halves of F.linear(x, w) (w packs gate and up), or of
    F.linear(x, w) and `up`."""
    y = F.linear(x, w)
    if up is None:
        y, up = y.split(y.shape[-1] // 2, dim=-1)
    return gelu_tanh_mul(y, up)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] in x's dtype; rotate_half pairs dims (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qkv_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, k_eq_v: bool):
    """A packed q/k/v projection's output [T, (Hq + Hkv [+ Hkv]) * D] -> (q, k, v) [T, H, D]: q and k normed
    with their weights and roped, v normed without weight. k_eq_v: there is no v block; v is the raw k."""
    T, D = qkv.shape[0], cos.shape[-1]
    blocks = qkv.split([num_q_heads * D] + [num_kv_heads * D] * (1 if k_eq_v else 2), dim=-1)
    q, k = blocks[0].view(T, -1, D), blocks[1].view(T, -1, D)
    v = k if k_eq_v else blocks[2].view(T, -1, D)
    return (apply_rope(rms_norm(q, q_weight, eps), cos, sin), apply_rope(rms_norm(k, k_weight, eps), cos, sin),
            rms_norm(v, None, eps))


def q_norm_rope(q: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """A KV-shared layer's projection [T, Hq * D] -> q [T, Hq, D], normed with `weight` and roped: the q part
    of `qkv_norm_rope`, for layers that compute no k or v."""
    return apply_rope(rms_norm(q.view(q.shape[0], -1, cos.shape[-1]), weight, eps), cos, sin)


def add_normed(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, eps: float,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma's post-norm residual step, residual + norm(x) * x_weight, times the layer's `scale` (its
    layer_scalar, a [1] tensor) where the step ends the layer. Each product and the sum are rounded
    to the model dtype, as HF's separate ops round them."""
    h = residual + rms_norm(x, x_weight, eps)
    return h if scale is None else h * scale


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                 eps: float, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_normed` followed by the next pre-norm: h, returned with norm(h) * out_weight. The next norm
    may be the next layer's input norm (or the final norm after the last layer): the layer's tail."""
    h = add_normed(residual, x, x_weight, eps, scale)
    return h, rms_norm(h, out_weight, eps)


def add_norm_gelu_linear(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor,
                         out_weight: torch.Tensor | None, eps: float, w: torch.Tensor,
                         up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual step and the gated GELU of a projection of it: h = add_normed(residual, x, x_weight), then
    gelu_linear of h (the PLE gate) or, with out_weight, of norm(h) * out_weight (the MLP's packed gate/up
    after the attention's residual step). Returns (h, the GELU)."""
    if out_weight is None:
        h = z = add_normed(residual, x, x_weight, eps)
    else:
        h, z = add_rms_norm(residual, x, x_weight, out_weight, eps)
    return h, gelu_linear(z, w, up)


def add_norm_linear(residual: torch.Tensor, x: torch.Tensor, x_weight: torch.Tensor, out_weight: torch.Tensor,
                    eps: float, scale: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's tail (`add_rms_norm`, ending in the next layer's input norm) and the next layer's first projection
    of its output by w (its packed q/k/v, or a KV-shared layer's q_proj): returns (h, the projection)."""
    h, z = add_rms_norm(residual, x, x_weight, out_weight, eps, scale)
    return h, F.linear(z, w)


def router_inputs(h: torch.Tensor, scale: torch.Tensor, root: float, experts_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block's two norms of the un-normed residual h: the router's input, norm(h) * scale * root
    (an unweighted norm, its scale vector, then 1/sqrt(H) as a Python float), and the experts' input,
    pre_feedforward_layernorm_2(h) = norm(h) * experts_weight."""
    return rms_norm(h, None, eps) * scale * root, rms_norm(h, experts_weight, eps)


def normed_sum(a: torch.Tensor, a_weight: torch.Tensor, b: torch.Tensor, b_weight: torch.Tensor,
               eps: float) -> torch.Tensor:
    """norm(a) * a_weight + norm(b) * b_weight: the MoE layer's dense and experts' branches, each through
    its post-norm (post_feedforward_layernorm_1, _2), summed."""
    return rms_norm(a, a_weight, eps) + rms_norm(b, b_weight, eps)


def route(logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routing from the router logits [T, E]: softmax in fp32 over all experts, then top-k,
    renormalised to sum 1, times per_expert_scale. Returns (w fp32 [T, k], idx int64 [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w * per_expert_scale[idx], idx


def softcap_logits(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The lm_head's output `x` -> fp32 logits: Gemma's final softcap tanh(x / cap) * cap in x's dtype (as HF
    computes it), then fp32; no softcap where `cap` is None."""
    if cap is not None:
        x = torch.tanh(x / cap) * cap
    return x.float()


def softcap_logits_(x: torch.Tensor, cap: float | None, out: torch.Tensor) -> None:
    """`softcap_logits` into `out` (fp32, x's shape): the decode graphs' shared logits buffer."""
    out.copy_(softcap_logits(x, cap))


REFERENCE = {"rms_norm": rms_norm, "route": route, "gelu_tanh_mul": gelu_tanh_mul, "qkv_norm_rope": qkv_norm_rope,
             "q_norm_rope": q_norm_rope, "add_rms_norm": add_rms_norm,
             "router_inputs": router_inputs, "normed_sum": normed_sum, "skinny_linear": F.linear,
             "gelu_linear": gelu_linear, "add_norm_gelu_linear": add_norm_gelu_linear,
             "add_norm_linear": add_norm_linear, "softcap_logits": softcap_logits, "softcap_logits_": softcap_logits_}
