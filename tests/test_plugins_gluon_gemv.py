"""The batch-1 skinny matmul whose programs copy their weight slice into shared memory before they wait
(plugins/gluon_gemv.py). Gluon has no interpreter: CI checks the rule by shape, the refusal off a Hopper GPU, and the
kernel compiled for sm_90 (every copy asked before the wait, x read after it); its numerics run on a Hopper GPU
(`python -m pytest tests/test_plugins_gluon_gemv.py` without TRITON_INTERPRET)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="the triton extra is not installed")

from g4rt.plugins import gluon_gemv as gg  # noqa: E402
from g4rt.plugins import launch  # noqa: E402
from g4rt.plugins import triton_gemv as tg  # noqa: E402

ON_HOPPER = not launch.interpreting() and torch.cuda.is_available() and launch.hopper(torch.device("cuda"))
# [N, K] of the E4B's and E2B's projections the rule gives the kernel: sliding packed q/k/v, sliding o_proj, PLE
# projection, KV-shared q_proj; the E4B's full q/k/v, full o_proj and KV-shared full q_proj; the E2B's down_proj
# (8-row slices for K over 3,072).
SHAPES = [(3072, 2560), (2560, 2048), (2560, 256), (2048, 2560), (2560, 1536), (1536, 2048), (1536, 256),
          (6144, 2560), (2560, 4096), (4096, 2560), (1536, 6144)]
SMS = launch.sm_count(torch.device("cpu"))  # an H200's, as the op counts them off CUDA


def test_the_rule_takes_one_bf16_row_against_a_small_weight_whose_slice_fits():
    bf16 = torch.bfloat16
    assert all(gg.copies_fit(1, n, k, bf16, SMS) for n, k in SHAPES)
    assert not gg.copies_fit(2, 3072, 2560, bf16, SMS)  # a second row: the Triton kernel
    assert not any(gg.copies_fit(1, 3072, 2560, dtype, SMS) for dtype in (torch.float32, torch.float16))
    assert not gg.copies_fit(1, 3080, 2560, bf16, SMS) and not gg.copies_fit(1, 3072, 2600, bf16, SMS)  # partial boxes
    assert [gg.slice_rows(k) for k in (256, 3072, 3328, 6144, 6400)] == [16, 16, 8, 8, None]
    assert not gg.copies_fit(1, 1536, 12288, bf16, SMS)  # the E2B's double-wide down_proj: a 192 KB 8-row slice
    assert not gg.copies_fit(1, 2560, 10240, bf16, SMS) and not gg.copies_fit(1, 16, 0, bf16, SMS)  # E4B down_proj
    assert not gg.copies_fit(1, 12288, 2560, bf16, SMS)  # 60 MiB: streamed
    assert not gg.copies_fit(1, 128, 2816, bf16, SMS)  # the 26B-A4B's router: 8 programs
    assert gg.kernel_fits(1, 128, 2816, bf16) and gg.kernel_fits(1, 12288, 2560, bf16)  # runs, not the op's choice
    assert not gg.kernel_fits(1, 1540, 6144, bf16) and not gg.kernel_fits(2, 3072, 2560, bf16)  # 8-row slices
    assert gg.copies_fit(1, 1056, 2816, bf16, SMS) and not gg.copies_fit(1, 1056, 2816, bf16, sms=133)  # 66 programs


def test_off_a_hopper_gpu_the_op_keeps_the_triton_kernel_and_the_launch_is_refused_by_shape():
    x = torch.randn(1, 2560, dtype=torch.bfloat16)
    w = torch.randn(3072, 2560, dtype=torch.bfloat16)
    assert not gg.copies_take(x, w) and not gg.gate_copies_take(x, w[:256])
    with pytest.raises(ValueError, match=r"got x \(1, 2560\) torch.bfloat16, w \(3072, 2560\)"):
        gg.copied_linear(x, w)
    with pytest.raises(ValueError, match=r"got x \(1, 2560\) torch.bfloat16, w \(256, 2560\)"):
        gg.copied_add_norm_gelu_linear(x, x, x[0], 1e-6, w[:256], x[:, :256])


COMPILE = """
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from g4rt.plugins.gluon_gemv import _copied_gemv_kernel as fn, BLOCK_K, GATE_WARPS, NUM_WARPS, W_LAYOUTS, slice_rows
k, norm, gelu = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
bn = slice_rows(k)
sig = {a: "*bf16" for a in fn.arg_names}
sig.update(w_desc=f"tensordesc<bf16[{bn}, {BLOCK_K}],{W_LAYOUTS[bn]!r}>", eps="fp32", K="i32")
const = dict(NT=k // BLOCK_K, XP=triton.next_power_of_2(k // BLOCK_K), BN=bn, BK=BLOCK_K, NORM=norm,
             HAS_SCALE=norm == 2, GELU=gelu, NUM_WARPS=GATE_WARPS if gelu else NUM_WARPS)
sig.update({a: "constexpr" for a in const})
c = triton.compile(GluonASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": const["NUM_WARPS"]})
lines = c.asm["ptx"].splitlines()
waits = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
copies = [i for i, l in enumerate(lines) if "cp.async.bulk.tensor" in l]
loads = [i for i, l in enumerate(lines) if re.search(r"ld\\.global", l)]
triggers = [i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l]
print(json.dumps({"shared": c.metadata.shared, "waits": len(waits), "copies": len(copies),
                  "triggers": len(triggers), "trigger_after_copies": max(copies) < triggers[0] < waits[0],
                  "copies_before": sum(i < waits[0] for i in copies), "loads_after": sum(i > waits[0] for i in loads),
                  "loads_before": sum(i < waits[0] for i in loads)}))
"""


@pytest.mark.parametrize("k, norm, gelu", [(256, 0, False), (2560, 0, False), (6144, 0, False), (2560, 2, False),
                                           (2560, 1, True)])
def test_the_kernel_compiles_for_sm_90_with_its_copies_before_the_wait_and_x_after(k, norm, gelu):
    """A subprocess without TRITON_INTERPRET: the slice's K / BLOCK_K copies are all asked before the program waits
    for the kernel before it, the next launch is let in after them and before the wait, and the shared memory is
    the slice (16 rows, 8 for K 6,144) within SLICE_BYTES, and x. Without the residual step nothing is read before the wait; with it
    (NORM 2, the layer's tail), the norms' weights and the layer scalar are (nothing writes them), x and the
    residual after it, as many loads as the two weights; the PLE gate's step (NORM 1, GELU) reads its one weight
    before, and x, the residual and the GELU's other factor after."""
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMPILE, str(k), str(norm), str(int(gelu))], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["waits"] == 1 and got["copies"] == got["copies_before"] == k // gg.BLOCK_K
    assert got["triggers"] == 1 and got["trigger_after_copies"]
    x_bytes = triton.next_power_of_2(k // gg.BLOCK_K) * gg.BLOCK_K * 2
    assert gg.slice_rows(k) * k * 2 + x_bytes <= got["shared"] <= gg.SLICE_BYTES + x_bytes + 1024
    if norm == 2:
        assert got["loads_before"] == got["loads_after"] + 1  # the two weights and the scalar; x and the residual
    elif norm == 1:
        assert got["loads_before"] > 0 and got["loads_after"] > 2 * got["loads_before"]
    else:
        assert got["loads_before"] == 0 and got["loads_after"] >= 1


def within_bf16(got: torch.Tensor, want: torch.Tensor, ulps: int) -> bool:
    """got within `ulps` bf16 ulps (of want's largest magnitude) of want."""
    bound = ulps * torch.finfo(torch.bfloat16).eps * want.double().abs().max().item()
    return (got.double() - want.double()).abs().max().item() <= bound


def counted(monkeypatch, name: str) -> list:
    """A list that grows by one at each call of triton_gemv's `name` (the Gluon launch the op takes)."""
    taken, launch = [], getattr(tg, name)
    monkeypatch.setattr(tg, name, lambda *a: taken.append(1) or launch(*a))
    return taken


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernel runs on a Hopper GPU only (no interpreter); CI compiles "
                                          "it for sm_90 instead")
@pytest.mark.parametrize("n, k", SHAPES)
def test_on_the_gpu_the_op_takes_the_kernel_within_bf16_rounding_of_a_float64_matmul(monkeypatch, n, k):
    """Fresh random bf16 inputs into a NaN-poisoned output: every column written, within bf16 rounding of the fp64
    product, the same bits on a second launch; `g4rt::skinny_linear` at one row takes it, at two rows not."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n + k)
    x = torch.randn(2, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
    want = x[:1].double() @ w.double().T
    out = torch.full((1, n), float("nan"), device=dev, dtype=torch.bfloat16)
    got = gg.copied_linear(x[:1], w, out=out)
    assert got is out and torch.isfinite(got).all()
    assert within_bf16(got, want, 2)
    assert torch.equal(gg.copied_linear(x[:1], w), got)
    taken = counted(monkeypatch, "copied_linear")
    assert torch.equal(torch.ops.g4rt.skinny_linear(x[:1], w), got)
    torch.ops.g4rt.skinny_linear(x, w)
    assert taken == [1]


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernel runs on a Hopper GPU only (no interpreter); CI compiles "
                                          "it for sm_90 instead")
@pytest.mark.parametrize("n, k, scaled", [(3072, 2560, True), (2048, 2560, False), (2560, 1536, True)])
def test_on_the_gpu_the_tail_and_the_next_projection_in_one_launch(monkeypatch, n, k, scaled):
    """`g4rt::add_norm_linear` at one row: one launch into NaN-poisoned outputs, h within a bf16 ulp (of its
    largest value) of add_rms_norm's, the projection within bf16 rounding of the fp64 product of add_rms_norm's
    normed row; at two rows add_rms_norm then skinny_linear, to the bit."""
    from g4rt.plugins import triton_norm as tn
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n + k)
    res, x = (torch.randn(2, k, device=dev, generator=g).bfloat16() for _ in range(2))
    xw, ow = (torch.rand(k, device=dev, generator=g).bfloat16() + 0.5 for _ in range(2))
    scale = torch.rand(1, device=dev, generator=g).bfloat16() + 0.5 if scaled else None
    w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
    want_h, z = tn.add_rms_norm(res[:1], x[:1], xw, ow, 1e-6, scale)
    want = z.double() @ w.double().T
    out = torch.full((1, n), float("nan"), device=dev, dtype=torch.bfloat16)
    h, y = gg.copied_add_norm_linear(res[:1], x[:1], xw, ow, 1e-6, scale, w, out=out)
    assert y is out and torch.isfinite(y).all() and torch.isfinite(h).all()
    assert within_bf16(h, want_h, 1) and within_bf16(y, want, 4)
    taken = counted(monkeypatch, "copied_add_norm_linear")
    h1, y1 = torch.ops.g4rt.add_norm_linear(res[:1], x[:1], xw, ow, 1e-6, scale, w)
    assert taken == [1] and torch.equal(h1, h) and torch.equal(y1, y)
    h2, y2 = torch.ops.g4rt.add_norm_linear(res, x, xw, ow, 1e-6, scale, w)
    h_two, z_two = tn.add_rms_norm(res, x, xw, ow, 1e-6, scale)
    assert taken == [1] and torch.equal(h2, h_two) and torch.equal(y2, torch.ops.g4rt.skinny_linear(z_two, w))


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernel runs on a Hopper GPU only (no interpreter); CI compiles "
                                          "it for sm_90 instead")
@pytest.mark.parametrize("k", [2560, 1536])
def test_on_the_gpu_the_ple_gate_and_its_residual_step_in_one_launch(monkeypatch, k):
    """`g4rt::add_norm_gelu_linear` for the PLE gate (no second norm, `up` a row-strided view like a layer's slice of
    the per-layer inputs) at one row: one launch into NaN-poisoned outputs, h within a bf16 ulp of add_normed's, the
    gated GELU within bf16 rounding of an fp64 one of add_normed's h; at two rows the Triton kernel."""
    from g4rt.models.blocks import add_normed
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(k)
    res, x = (torch.randn(2, k, device=dev, generator=g).bfloat16() for _ in range(2))
    xw = torch.rand(k, device=dev, generator=g).bfloat16() + 0.5
    w = (torch.randn(256, k, device=dev, generator=g) / k ** 0.5).bfloat16()
    up = torch.randn(2, 3, 256, device=dev, generator=g).bfloat16()[:, 1]  # row stride 768, unit column stride
    want_h = add_normed(res[:1], x[:1], xw, 1e-6)
    gate = (want_h.double() @ w.double().T).bfloat16().double()
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up[:1].double()
    out = torch.full((1, 256), float("nan"), device=dev, dtype=torch.bfloat16)
    h, y = gg.copied_add_norm_gelu_linear(res[:1], x[:1], xw, 1e-6, w, up[:1], out=out)
    assert y is out and torch.isfinite(y).all() and torch.isfinite(h).all()
    assert within_bf16(h, want_h, 1) and within_bf16(y, want, 8)
    taken = counted(monkeypatch, "copied_add_norm_gelu_linear")
    h1, y1 = torch.ops.g4rt.add_norm_gelu_linear(res[:1], x[:1], xw, None, 1e-6, w, up[:1])
    assert taken == [1] and torch.equal(h1, h) and torch.equal(y1, y)
    torch.ops.g4rt.add_norm_gelu_linear(res, x, xw, None, 1e-6, w, up)
    assert taken == [1]
