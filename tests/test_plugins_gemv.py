"""The skinny-matmul kernel (plugins/triton_gemv.py) against an fp64 matmul, under the Triton interpreter."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; `make test` sets it too

import pytest
import torch

pytest.importorskip("triton", reason="the triton extra is not installed")

import triton  # noqa: E402

from g4rt.plugins import launch  # noqa: E402
from g4rt.plugins import triton_gemv as tg  # noqa: E402


@pytest.mark.parametrize("m,n,k", [(1, 64, 512), (3, 100, 300), (16, 48, 1030), (8, 16, 16), (40, 40, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_a_float64_matmul(m, n, k, dtype):
    """Every output, ragged N and K included (the masked tiles), within the dtype's rounding of the fp64
    product; the poisoned output is written everywhere and nothing past it."""
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n + 3, k, generator=g) / k ** 0.5).to(dtype)[:n]  # rows strided past the used ones
    out = torch.full((m + 1, n), float("nan"), dtype=dtype)
    got = tg.gemv(x, w, config=(16, 128, 4, 2), out=out[:m])
    want = (x.double() @ w.double().T).to(dtype)
    assert torch.isfinite(out[:m]).all() and out[m].isnan().all()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps * want.float().abs().max().item())


@pytest.mark.parametrize("config", tg.GEMV_CONFIGS)
def test_every_bench_config_computes_the_same_values(config):
    """Unsplit: the tile shape changes the order of the fp32 sums only, never which outputs a program
    writes."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 1024, generator=g), torch.randn(96, 1024, generator=g)
    torch.testing.assert_close(tg.gemv(x, w, config=config), x @ w.T, rtol=1e-5, atol=1e-4)


def test_gemv_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="at most 128 rows of x, got 129"):
        tg.gemv(torch.zeros(129, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\], got x \(2, 8\) and w \(4, 9\)"):
        tg.gemv(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="torch.float32 and w is torch.bfloat16"):
        tg.gemv(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous along K"):
        tg.gemv(torch.zeros(8, 2).t(), torch.zeros(4, 8))


def test_the_bench_records_each_config_and_the_fastest(monkeypatch):
    """bench/engine.py `gemv_record` (what `--matmuls` runs on the GPU), with the graph timing replaced by
    a clock that makes the third config fastest and a config that fails: every config is recorded, the
    failing one by its error, and the fastest is reported. Its sweep lists are the bench's, not the library's."""
    from g4rt.bench import engine
    assert not any(hasattr(tg, name) for name in ("GEMV_SPLITS", "SERVING_CONFIGS", "SERVING_SPLITS"))
    configs = tg.GEMV_CONFIGS[:3] + [(16, 100, 4, 2)]  # block_k 100 is no power of two: Triton refuses it
    monkeypatch.setattr(tg, "GEMV_CONFIGS", configs)
    monkeypatch.setattr(engine, "GEMV_SPLITS", ())  # the op's plan for this weight is configs[0], unsplit
    clock = iter([3.0, 2.0, 1.0])
    monkeypatch.setattr(engine, "graph_ms", lambda fn, reps: (fn(), next(clock))[1])
    g = torch.Generator().manual_seed(2)
    mats = [torch.randn(32, 256, generator=g).to(torch.bfloat16) for _ in range(2)]
    rec = engine.gemv_record(torch.randn(1, 256, generator=g).to(torch.bfloat16), mats, reps=3)
    assert rec["ms"] == 1.0 and rec["best_config"] == [*configs[2], 1] and rec["layers"] == 2
    assert rec["op_config"] == [*configs[0], 1] and rec["op_ms"] == 3.0
    assert [c["ms"] for c in rec["configs"][:3]] == [3.0, 2.0, 1.0] and all(c["rel_err"] < 2e-2 for c in rec["configs"][:3])
    assert "error" in rec["configs"][3]
    monkeypatch.setattr(engine, "graph_ms", lambda fn, reps: (fn(), 1.0)[1])
    rows = torch.randn(tg.SKINNY_ROWS + 1, 256, generator=g).to(torch.bfloat16)  # the op runs a BLAS library
    rec = engine.gemv_record(rows, mats, reps=3)
    assert rec["op_config"] is None and rec["op_ms"] is None and not rec["op_takes_kernel"]
    assert [c["config"] for c in rec["configs"]] == [[*c, 1] for c in configs]


def test_the_bench_times_each_role_over_weights_of_one_shape(monkeypatch):
    """bench/engine.py `matmul_roles` on the tiny E2B, whose KV-shared layers have twice the MLP width:
    each record's weights share one shape (a role of mixed shapes could not run as one matmul loop), and
    the packed forms are the weights pack_weights packs (q/k/v only where a layer owns its cache)."""
    from conftest import tiny_config

    from g4rt.bench import engine
    from g4rt.models.checkpoint import random_model
    monkeypatch.setattr(engine, "graph_ms", lambda fn, reps: (fn(), 1.0)[1])  # runs each form's matmuls once
    monkeypatch.setattr(engine, "gemv_record", lambda x, mats, reps: {"stage": "matmul_roles", "ms": 1.0})
    cfg = tiny_config("e2b")
    model = random_model(cfg, torch.float32, "cpu", seed=0)
    recs = [r for r in engine.matmul_roles(model, bw=1e3, batches=(1,), reps=1) if "shape" in r]
    downs = {tuple(r["shape"]) for r in recs if r["role"].endswith("mlp.down_proj") and r["form"] == "out_in"}
    assert downs == {(cfg.hidden_size, cfg.intermediate_size), (cfg.hidden_size, 2 * cfg.intermediate_size)}
    shared = sum(layer.self_attn.k_proj is None for layer in model.layers)
    qkv = [r for r in recs if r["role"].endswith("self_attn.qkv")]
    assert shared and sum(r["layers"] for r in qkv) == len(model.layers) - shared
    lm = [r for r in recs if r["role"] == "lm_head"]
    assert {r["form"] for r in lm} == {"out_in", "in_out"} and lm[0]["shape"] == [cfg.vocab_size, cfg.hidden_size]


def test_skinny_linear_takes_the_kernel_for_few_rows_of_a_wide_split_or_small_weight():
    """`g4rt::skinny_linear` (every projection of the model): the Triton kernel for up to SKINNY_ROWS rows of
    a weight with at least one MODEL_CONFIG column block per SM (132 off CUDA), one narrower with K long
    enough to be cut over K (the 31B's o_proj and down_proj, the E4B's down_proj) or one of at most
    NARROW_BYTES (the E2B's and E4B's q/k/v), within fp32 rounding of the fp64 product; F.linear, to the
    bit, for more rows or a weight narrow, short along K and large."""
    def weight(n, k):
        return torch.empty(n, k, dtype=torch.bfloat16, device="meta")
    wide = tg.MODEL_CONFIG[0] * 132
    assert tg.takes_gemv(tg.SKINNY_ROWS, weight(wide, 5376)) and not tg.takes_gemv(tg.SKINNY_ROWS + 1, weight(wide, 8))
    assert tg.takes_gemv(1, weight(5376, 8192)) and tg.takes_gemv(1, weight(2560, 10240))
    assert tg.takes_gemv(1, weight(3072, 2560)) and not tg.takes_gemv(1, weight(8000, 4000))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(wide, 96, generator=g) / 96 ** 0.5
    x = torch.randn(tg.SKINNY_ROWS + 1, 96, generator=g)
    for rows in (w, w[:100]):  # a MODEL_CONFIG launch and a narrow one
        got = torch.ops.g4rt.skinny_linear(x[:3], rows)
        torch.testing.assert_close(got, (x[:3].double() @ rows.double().T).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.ops.g4rt.skinny_linear(x, w), torch.nn.functional.linear(x, w))
    long_k = torch.randn(100, tg.SPLIT_MIN_K + 40, generator=g) / tg.SPLIT_MIN_K ** 0.5  # a split launch
    assert tg.gemv_plan(*long_k.shape, long_k.device)[1] > 1
    xk = torch.randn(2, long_k.shape[1], generator=g)
    torch.testing.assert_close(torch.ops.g4rt.skinny_linear(xk, long_k), (xk.double() @ long_k.double().T).float(),
                               rtol=1e-5, atol=1e-5)


def test_the_plan_gives_every_sm_a_program_or_three_fifths_of_them():
    """gemv_plan on the H200's 132 SMs: 64 columns where they give every SM a program; a narrower weight
    with K >= SPLIT_MIN_K keeps them and is cut over K into the most runs that keep its programs within
    SPLIT_PROGRAMS an SM (at most MAX_SPLITS);
    a shorter one gets the widest tile whose blocks number at least 3/5 of the SMs (the E4B's 2,560 and 3,072
    columns: 32, the E2B's 1,536 and 2,048: 16); one narrower than any tile makes that (the PLE gates' 256
    columns, the router's 128) gets the 32-column tile cut over K from NARROW_SPLIT_MIN_K on."""
    cpu = torch.device("cpu")
    assert tg.gemv_plan(64 * 132, 5376, cpu) == (tg.MODEL_CONFIG, 1)
    assert tg.gemv_plan(5376, 8192, cpu) == (tg.MODEL_CONFIG, 4)  # 84 blocks: 336 programs (5 runs measured slower)
    assert tg.gemv_plan(2560, 10240, cpu) == (tg.MODEL_CONFIG, 9)  # 40 blocks: 360 programs of 396
    assert tg.gemv_plan(1536, 6144, cpu) == (tg.MODEL_CONFIG, tg.MAX_SPLITS)  # 24 blocks: 384
    assert tg.gemv_plan(256, 8192, cpu) == (tg.MODEL_CONFIG, tg.MAX_SPLITS)
    assert tg.gemv_plan(5120, 1536, cpu) == (tg.MODEL_CONFIG, 1)  # 80 blocks: 3/5 of 132
    assert tg.gemv_plan(2560, 2048, cpu) == (tg.NARROW_CONFIGS[0], 1) and tg.gemv_plan(3072, 2560, cpu)[0][0] == 32
    assert tg.gemv_plan(2048, 2560, cpu) == (tg.NARROW_CONFIGS[-1], 1) and tg.gemv_plan(1536, 256, cpu)[0][0] == 16
    assert tg.gemv_plan(256, 2560, cpu) == (tg.NARROW_CONFIGS[0], tg.MAX_SPLITS) == tg.gemv_plan(256, 1536, cpu)
    assert tg.gemv_plan(128, 2816, cpu) == (tg.NARROW_CONFIGS[0], tg.MAX_SPLITS)  # 4 blocks
    assert tg.gemv_plan(256, 1024, cpu) == (tg.NARROW_CONFIGS[-1], 1)  # K below NARROW_SPLIT_MIN_K
    fits = tg.SPLIT_PROGRAMS * 132
    for n in range(64, 64 * 132, 64):  # every cut weight: within SPLIT_PROGRAMS an SM, and one run more is not
        (bn, *_), runs = tg.gemv_plan(n, 8192, cpu)
        blocks = triton.cdiv(n, bn)
        assert blocks * runs <= fits and (runs == tg.MAX_SPLITS or blocks * (runs + 1) > fits), n


def test_the_packed_gate_up_with_its_gelu_takes_three_stages_where_model_config_is_unsplit(monkeypatch):
    """A packed gate/up with the GELU epilogue and K of at least PACKED_GELU_MIN_K (the E4B's MLP) takes
    PACKED_GELU_CONFIG: MODEL_CONFIG's tile (so the sums' order) at 3 stages; a shorter K (the E2B's 1,536), a
    split or narrow plan is the same with or without the epilogue (the 26B-A4B's packed gate/up [4,224 x 2,816]
    keeps its 32-column tile); the plain launch keeps MODEL_CONFIG."""
    cpu = torch.device("cpu")
    assert tg.PACKED_GELU_CONFIG[:3] == tg.MODEL_CONFIG[:3] and tg.PACKED_GELU_CONFIG[3] == 3
    assert tg.gemv_plan(20480, 2560, cpu, packed_gelu=True) == (tg.PACKED_GELU_CONFIG, 1)
    assert tg.gemv_plan(20480, 2560, cpu) == (tg.MODEL_CONFIG, 1)
    for n, k in ((4224, 2816), (2560, 10240), (256, 2560), (24576, 1536), (12288, 1536)):
        assert tg.gemv_plan(n, k, cpu, packed_gelu=True) == tg.gemv_plan(n, k, cpu)
    configs = []

    def recorded(x, w, config, halves=False, **kw):  # the launch's plan, not the launch
        configs.append((config, halves))
        return x.new_empty(x.shape[0], w.shape[0] // (2 if halves else 1))
    monkeypatch.setattr(tg, "gemv", recorded)
    k = tg.PACKED_GELU_MIN_K
    w = torch.zeros(tg.MODEL_CONFIG[0] * 132, k)
    torch.ops.g4rt.gelu_linear(torch.zeros(1, k), w, None)
    torch.ops.g4rt.skinny_linear(torch.zeros(1, k), w)
    torch.ops.g4rt.gelu_linear(torch.zeros(1, k - 8), w[:, 8:], None)
    assert configs == [(tg.PACKED_GELU_CONFIG, True), (tg.MODEL_CONFIG, False), (tg.MODEL_CONFIG, True)]


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_a_split_launch_adds_its_runs_in_order_and_leaves_the_counters_at_zero(splits):
    """K cut into runs (ragged K: the last run is short): within rounding of the fp64 product, the same bits
    on a second launch (the runs are added in run order, whichever program finishes last), the poisoned
    output written everywhere, and every column block's counter back at zero for the next launch."""
    g = torch.Generator().manual_seed(splits)
    x = torch.randn(3, 1000, generator=g).to(torch.bfloat16)
    w = (torch.randn(80, 1000, generator=g) / 1000 ** 0.5).to(torch.bfloat16)
    out = torch.full((3, 80), float("nan"), dtype=torch.bfloat16)
    got = tg.gemv(x, w, config=(16, 128, 4, 2), out=out, splits=splits)
    want = (x.double() @ w.double().T).float()
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got.float(), want, rtol=2 * eps, atol=2 * eps * want.abs().max().item())
    assert torch.equal(tg.gemv(x, w, config=(16, 128, 4, 2), splits=splits), got)
    assert not tg._locks(x.device).any()


def reference_gelu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


@pytest.mark.parametrize("m,splits", [(1, 1), (3, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gelu_epilogue_is_the_gelu_kernel_on_the_matmul_output_to_the_bit(m, splits, dtype):
    """The gated GELU in the epilogue (a ragged N and K; a split launch too) is what the gelu kernel computes
    from the plain launch's rounded output, bit for bit: of its two halves (`halves`, the MLP's packed gate/up)
    or of it and `up` (the PLE gate, up a row-strided view); near the fp64 GELU of the fp64 product; the
    poisoned output written everywhere and nothing past it; the split's counters back at zero."""
    from g4rt.plugins import triton_norm as tn
    g = torch.Generator().manual_seed(10 * m + splits)
    n, k, config = 70, 300, (16, 64, 4, 2)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (2 * torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype)
    up = torch.randn(m, n + 5, generator=g).to(dtype)[:, :n]
    eps = torch.finfo(dtype).eps
    for gelu, want in (({"halves": True}, reference_gelu(*(x.double() @ w.double().T).split(n, dim=1))),
                       ({"up": up[:, :n]}, reference_gelu(x.double() @ w[:n].double().T, up.double()))):
        wg = w if "halves" in gelu else w[:n]
        out = torch.full((m + 1, n), float("nan"), dtype=dtype)
        got = tg.gemv(x, wg, config=config, out=out[:m], splits=splits, **gelu)
        assert torch.isfinite(out[:m]).all() and out[m].isnan().all()
        plain = tg.gemv(x, wg, config=config, splits=splits)
        assert torch.equal(got, tn.gelu_tanh_mul(*plain.split(n, dim=1)) if "halves" in gelu
                           else tn.gelu_tanh_mul(plain, up))
        torch.testing.assert_close(got.double(), want, rtol=8 * eps, atol=8 * eps * want.abs().max().item())
    assert not tg._locks(x.device).any()


def test_gelu_linear_takes_the_epilogue_for_few_rows_and_the_gelu_kernel_for_more(monkeypatch):
    """`g4rt::gelu_linear` (the MLP's packed gate/up, the PLE gate): for up to SKINNY_ROWS rows the epilogue
    launch, to the bit what skinny_linear then the gelu kernel give, an up strided over rows (a layer's slice
    of the per-layer inputs) read in place; beyond, F.linear then the gelu kernel, to the bit; a packed weight
    above EPILOGUE_MAX_BYTES the plain launch then the gelu kernel (the PLE gate still fused); a packed weight
    of odd rows or an up of the wrong shape refused by name."""
    from g4rt.plugins import triton_norm as tn
    g = torch.Generator().manual_seed(4)
    w = torch.randn(192, 96, generator=g) / 96 ** 0.5
    x = torch.randn(tg.SKINNY_ROWS + 1, 96, generator=g)
    up = torch.randn(tg.SKINNY_ROWS + 1, 2, 192, generator=g)[:, 1]
    assert up.stride(0) == 2 * 192
    for rows in (x[:2], x):
        y = torch.ops.g4rt.skinny_linear(rows, w)
        assert torch.equal(torch.ops.g4rt.gelu_linear(rows, w, None), tn.gelu_tanh_mul(*y.split(96, dim=1)))
        assert torch.equal(torch.ops.g4rt.gelu_linear(rows, w, up[:len(rows)]), tn.gelu_tanh_mul(y, up[:len(rows)]))
    launches = []
    gemv = tg.gemv
    def recorded(*args, **kwargs):
        launches.append((kwargs.get("halves", False), kwargs.get("up") is not None))
        return gemv(*args, **kwargs)
    # A packed weight above EPILOGUE_MAX_BYTES: the plain launch, then the gelu kernel; the PLE gate: fused.
    monkeypatch.setattr(tg, "gemv", recorded)
    monkeypatch.setattr(tg, "EPILOGUE_MAX_BYTES", w.numel() * w.element_size() - 1)
    y = torch.ops.g4rt.skinny_linear(x[:2], w)
    assert torch.equal(torch.ops.g4rt.gelu_linear(x[:2], w, None), tn.gelu_tanh_mul(*y.split(96, dim=1)))
    assert torch.equal(torch.ops.g4rt.gelu_linear(x[:2], w, up[:2]), tn.gelu_tanh_mul(y, up[:2]))
    monkeypatch.undo()
    assert launches == [(False, False), (False, False), (False, True)]
    with pytest.raises(ValueError, match="halves need an even row count of w and no up, got 191 rows"):
        tg.gemv(x[:2], w[:191], halves=True)
    with pytest.raises(ValueError, match=r"gemv's up must be \[2, 192\]"):
        tg.gemv(x[:2], w, up=up[:3])


@pytest.mark.parametrize("m,splits", [(1, 1), (3, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_residual_prologue_is_the_norm_kernel_then_the_matmul(m, splits, dtype):
    """The residual step in the prologue (ResidualNorm; ragged N and K, a split launch too): h is the
    add_normed kernel's and the output what the epilogue launch computes from the add_rms_norm kernel's
    second output (or, with no out_weight, from h), each within one ulp of them (the norms' sums are taken
    in another order); the GELU near the fp64 chain; the poisoned h and output written everywhere and nothing
    past them; the split's counters back at zero; a residual, h or weight of the wrong shape refused by name."""
    from g4rt.models import blocks
    from g4rt.plugins import triton_norm as tn
    g = torch.Generator().manual_seed(7 * m + splits)
    n, k, config, eps = 70, 300, (16, 64, 4, 2), 1e-6
    res = torch.randn(m, k, generator=g).to(dtype)
    x = (3 * torch.randn(m, k, generator=g) + 0.5).to(dtype)
    w1, w2 = ((1 + 0.3 * torch.randn(k, generator=g)).to(dtype) for _ in range(2))
    w = (2 * torch.randn(2 * n, k, generator=g) / k ** 0.5).to(dtype)
    up = torch.randn(m, n, generator=g).to(dtype)
    ulp = torch.finfo(dtype).eps
    for out_weight, gelu in ((w2, {"halves": True}), (None, {"up": up})):
        wg = w if "halves" in gelu else w[:n]
        h = torch.full((m + 1, k), float("nan"), dtype=dtype)
        out = torch.full((m + 1, n), float("nan"), dtype=dtype)
        got = tg.gemv(x, wg, config=config, out=out[:m], splits=splits,
                      norm=tg.ResidualNorm(res, w1, out_weight, eps, h[:m]), **gelu)
        assert torch.isfinite(h[:m]).all() and h[m].isnan().all()
        assert torch.isfinite(out[:m]).all() and out[m].isnan().all()
        want_h = tn.add_normed(res, x, w1, eps)
        z = want_h if out_weight is None else tn.add_rms_norm(res, x, w1, out_weight, eps)[1]
        want = tg.gemv(z, wg, config=config, splits=splits, **gelu)
        for a, b in ((h[:m], want_h), (got, want)):
            torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=ulp * b.float().abs().max().item())
        chain = blocks.add_norm_gelu_linear(res.double(), x.double(), w1.double(),
                                            None if out_weight is None else out_weight.double(), eps, wg.double(),
                                            None if out_weight is not None else up.double())[1]
        torch.testing.assert_close(got.double(), chain, rtol=16 * ulp, atol=16 * ulp * chain.abs().max().item())
    assert not tg._locks(x.device).any()
    bad = tg.ResidualNorm(res[:, :-1], w1, w2, eps, torch.empty_like(res))
    with pytest.raises(ValueError, match=r"gemv's residual must be a contiguous \(" + str(m)):
        tg.gemv(x, w, norm=bad, halves=True)
    with pytest.raises(ValueError, match=r"gemv's out_weight must be a contiguous \[300\] vector"):
        tg.gemv(x, w, norm=tg.ResidualNorm(res, w1, w2[:-1], eps, torch.empty_like(res)), halves=True)


def test_add_norm_gelu_linear_fuses_for_few_rows_and_is_the_two_kernels_for_more(monkeypatch):
    """`g4rt::add_norm_gelu_linear`: for up to SKINNY_ROWS rows one launch with the residual step as its
    prologue (the MLP after the attention's step with out_weight; the PLE gate with an up strided over rows);
    beyond, the norm kernel then gelu_linear, to the bit; both within an ulp of each other's h."""
    from g4rt.plugins import triton_norm as tn
    g = torch.Generator().manual_seed(5)
    rows, k = tg.SKINNY_ROWS + 1, 96
    res, x = torch.randn(rows, k, generator=g), 2 * torch.randn(rows, k, generator=g)
    w1, w2 = 1 + 0.2 * torch.randn(k, generator=g), 1 + 0.2 * torch.randn(k, generator=g)
    w = torch.randn(192, k, generator=g) / k ** 0.5
    up = torch.randn(rows, 2, 192, generator=g)[:, 1]
    launches = []
    gemv = tg.gemv
    def recorded(*args, **kwargs):
        launches.append(kwargs.get("norm") is not None)
        return gemv(*args, **kwargs)
    monkeypatch.setattr(tg, "gemv", recorded)
    for n in (2, rows):
        for ow, wg, u in ((w2, w, None), (None, w, up[:n])):
            h, y = torch.ops.g4rt.add_norm_gelu_linear(res[:n], x[:n], w1, ow, 1e-6, wg, u)
            want_h, z = (tn.add_normed(res[:n], x[:n], w1, 1e-6), None) if ow is None else \
                tn.add_rms_norm(res[:n], x[:n], w1, ow, 1e-6)
            want = torch.ops.g4rt.gelu_linear(want_h if z is None else z, wg, u)
            if n > tg.SKINNY_ROWS:
                assert torch.equal(h, want_h) and torch.equal(y, want)
            else:
                torch.testing.assert_close(h, want_h, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    assert launches == [True, False, True, False]


@pytest.mark.parametrize("rows", [17, 64, 100])
def test_serving_rows_take_a_row_tile_of_their_own_and_split_the_same_way(rows):
    """More than 16 rows (a serving batch) run in one row tile of the next power of two: every row within
    fp32 rounding of the fp64 product, poisoned rows past M untouched; cut over K, the partials are added in
    run order by the block's last program, so two launches give the same bits."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 192, generator=g)
    w = torch.randn(40, 192, generator=g) / 192 ** 0.5
    want = x.double() @ w.double().T
    assert tg.row_tile(rows) == max(32, 1 << (rows - 1).bit_length()) and tg.row_tile(3) == 16
    for splits in (1, 3):
        out = torch.full((rows + 1, 40), float("nan"))
        tg.gemv(x, w, config=(16, 32, 4, 2), out=out[:rows], splits=splits)
        assert out[rows].isnan().all()
        torch.testing.assert_close(out[:rows].double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(tg.gemv(x, w, config=(16, 32, 4, 2), splits=splits), out[:rows])


@pytest.mark.skipif(launch.interpreting() or not torch.cuda.is_available(),
                    reason="the compiled kernel: needs a CUDA GPU and TRITON_INTERPRET=0 (this file defaults it to 1)")
@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("n,k", [(5376, 21504), (16384, 5376)])
def test_serving_tiles_on_the_gpu_match_a_float64_matmul(rows, n, k):
    """Every serving tile the bench sweeps, at the 31B's down_proj and sliding packed q/k/v shapes,
    unsplit and cut over K, on fresh random bf16 inputs into a NaN-poisoned output: within bf16 rounding of
    the fp64 product (the sums are fp32 over K)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(rows + n + k)
    x = torch.randn(rows, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
    want = (x.double() @ w.double().T)
    tol = 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    ran = 0
    from g4rt.bench.engine import SERVING_CONFIGS, SERVING_SPLITS
    for config in SERVING_CONFIGS:
        for splits in (1, *SERVING_SPLITS):
            out = torch.full((rows, n), float("nan"), device=dev, dtype=torch.bfloat16)
            try:
                tg.gemv(x, w, config=config, out=out, splits=splits)
            except triton.runtime.errors.OutOfResources:  # a tile whose stages overflow shared memory at these rows
                continue
            err = (out.double() - want).abs().max().item()
            assert err <= tol, (config, splits, err, tol)
            ran += 1
    assert ran >= (len(SERVING_CONFIGS) - 1) * (1 + len(SERVING_SPLITS))  # all but one tile at 128 rows


def test_cublaslt_takes_long_k_weights_from_9_rows_to_128():
    """The BLAS library by shape (cublaslt_takes): the 31B's o_proj and down_proj (K > N) at 9-64 rows, its
    down_proj and full o_proj (K >= 3N) at 65-128; cuBLAS for its sliding o_proj there, for weights with N > K,
    for the E2B's 1,536-wide ones, and for fewer or more rows. Off CUDA, blas_linear is F.linear."""
    assert tg.cublaslt_takes(128, 2560, 10240) and not tg.cublaslt_takes(64, 1536, 12288)
    assert tg.cublaslt_takes(64, 5376, 21504) and tg.cublaslt_takes(tg.SKINNY_ROWS + 1, 5376, 8192)
    assert tg.cublaslt_takes(128, 5376, 21504) and tg.cublaslt_takes(65, 5376, 16384)
    assert not tg.cublaslt_takes(65, 5376, 8192) and not tg.cublaslt_takes(128, 5376, 8192)
    for rows in (1, tg.SKINNY_ROWS, 129, 256):
        assert not tg.cublaslt_takes(rows, 5376, 21504)
    for rows in (64, 128, 256):
        assert not tg.cublaslt_takes(rows, 43008, 5376) and not tg.cublaslt_takes(rows, 262144, 5376)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(64, 48, generator=g), torch.randn(16, 48, generator=g)
    assert torch.equal(tg.blas_linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.skipif(launch.interpreting() or not torch.cuda.is_available(),
                    reason="cuBLASLt: needs a CUDA GPU and TRITON_INTERPRET=0 (this file defaults it to 1)")
@pytest.mark.parametrize("rows,n,k", [(64, 5376, 8192), (128, 5376, 21504), (128, 5376, 8192)])
def test_blas_linear_on_the_gpu_sets_the_library_for_its_call_only(rows, n, k):
    """On fresh random bf16 inputs, within bf16 rounding of the fp64 product whichever library the rule names,
    and torch's preferred library as it was after the call."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(rows + n)
    x = torch.randn(rows, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
    before = torch.backends.cuda.preferred_blas_library()
    got = tg.blas_linear(x, w)
    assert torch.backends.cuda.preferred_blas_library() == before
    want = x.double() @ w.double().T
    assert (got.double() - want).abs().max().item() <= 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
