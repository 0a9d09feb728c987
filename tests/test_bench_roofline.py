"""The bench's rooflines (bench/engine.py), which every GPU number is printed beside: the bytes a decode
step really reads, and the bounds built from them and from its FLOPs."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from g4rt.bench.engine import (attention_flops, expert_bytes, exposure, kv_bytes_per_step, matmul_params,
                              roofline, weight_bytes_per_step)
from g4rt.models.model import Gemma4Model


@pytest.fixture(scope="module")
def e2b():
    return Gemma4Model(tiny_config("e2b"), dtype=torch.bfloat16, device="meta")


def test_a_step_reads_only_the_looked_up_rows_of_the_per_layer_table(e2b):
    table = e2b.embed_tokens_per_layer.weight
    row = table.shape[1] * table.element_size()
    whole = sum(p.numel() * p.element_size() for p in e2b.parameters())
    assert weight_bytes_per_step(e2b, 1) == whole - (table.shape[0] - 1) * row
    assert weight_bytes_per_step(e2b, 7) - weight_bytes_per_step(e2b, 1) == 6 * row


def test_past_the_window_only_the_full_layers_read_more_kv(e2b):
    layout = e2b.layout
    window = max(layer.window for layer in layout.layers if layer.sliding)
    full = sum(not layer.sliding for layer in layout.layers)  # KV-shared layers read their source's again
    grow = kv_bytes_per_step(e2b, 3, window + 9) - kv_bytes_per_step(e2b, 3, window + 4)
    assert grow == 3 * 5 * full * layout.full.bytes_per_token_per_layer


def test_the_serial_floor_adds_the_matmuls_bound_to_the_attentions(e2b):
    """Bytes-bound at batch 1: the serial floor is the byte roofline. With a matmul rate low enough that
    the matmuls are compute-bound but the attention is not, it is the matmuls' FLOP time plus the KV
    time, above both the byte roofline and the FLOP floor."""
    bw = 1e6  # bytes/s: slow ceilings keep the tiny model's times clear of the records' 3-decimal rounding
    one = roofline(e2b, 1, 40, {"copy_GBps": bw / 1e9, "matmul_TFLOPs": 1.0})
    assert one["serial_floor_ms"] == one["roofline_step_ms"]
    batch, ctx = 64, 40
    w, kv = weight_bytes_per_step(e2b, batch), kv_bytes_per_step(e2b, batch, ctx)
    mm = 2.0 * matmul_params(e2b) * batch
    at = batch * attention_flops(e2b, [ctx - 1])
    peak = mm / (1.5 * w / bw)  # FLOP/s at which the matmuls take 1.5x their weight bytes' time
    assert at / peak < kv / bw  # the attention stays bytes-bound
    r = roofline(e2b, batch, ctx, {"copy_GBps": bw / 1e9, "matmul_TFLOPs": peak / 1e12})
    assert r["serial_floor_ms"] == pytest.approx((mm / peak + kv / bw) * 1e3, rel=1e-4)
    assert r["serial_floor_ms"] > max(r["roofline_step_ms"], r["flop_floor_ms"])
    assert r["serial_tok_s_total"] == pytest.approx(batch / r["serial_floor_ms"] * 1e3, rel=1e-3)


def test_a_mixture_of_experts_step_reads_and_runs_only_the_experts_its_routers_pick():
    """At batch 1 a layer reads and runs its top_k experts, not all E (counting all of them put the 26B-A4B's
    steps above their roofline); as the batch grows the distinct experts approach E, and the bytes those of
    every weight; the FLOPs grow with top_k experts a token whatever the batch."""
    moe = Gemma4Model(tiny_config("26b"), dtype=torch.bfloat16, device="meta")
    cfg = moe.config
    E, k, L = cfg.num_experts, cfg.top_k_experts, cfg.num_hidden_layers
    ceil = {"copy_GBps": 1e-3, "matmul_TFLOPs": 1e-6}
    one = roofline(moe, 1, 40, ceil)
    assert one["weight_bytes"] == weight_bytes_per_step(moe, 1) - (E - k) * L * expert_bytes(moe)
    many = roofline(moe, 4096, 40, ceil)
    assert many["weight_bytes"] == pytest.approx(weight_bytes_per_step(moe, 4096), rel=1e-9)
    assert one["weight_bytes"] < roofline(moe, 2, 40, ceil)["weight_bytes"] < many["weight_bytes"]
    token = matmul_params(moe) - (E - k) * L * expert_bytes(moe) // 2  # bf16: 2 bytes a parameter
    assert one["flop_floor_ms"] == pytest.approx((2 * token + attention_flops(moe, [39])) / 1e6 * 1e3, rel=1e-3)


def test_a_kernel_is_charged_only_what_it_adds_past_the_kernels_before_it():
    """The decode profile's exposed times (bench.engine.exposure): a kernel launched early under PDL that
    ends inside the one before adds nothing, one that ends after it adds the difference, a gap is idle, and
    launches group by name and grid; the exposed times and the idle stretches add up to the span."""
    runs = [(0.0, 10.0, "gemv", (320, 1, 1)),
            (2.0, 9.0, "norm", (1, 1, 1)),       # started early, ended inside the gemv: nothing exposed
            (8.0, 14.0, "gemv", (80, 1, 1)),     # 4 past the reach of 10
            (16.0, 20.0, "gemv", (320, 1, 1)),   # after 2 idle: its whole 4
            (17.0, 25.0, "norm", (1, 1, 1))]     # 5 past 20
    got = exposure(runs)
    assert got["span_ms"] == 0.025 and got["idle_ms"] == 0.002 and got["kernels"] == 5
    assert got["by_launch"] == [["gemv", [320, 1, 1], 2, 0.014, 0.014], ["norm", [1, 1, 1], 1 + 1, 0.005, 0.015],
                                ["gemv", [80, 1, 1], 1, 0.004, 0.006]]
    assert sum(g[3] for g in got["by_launch"]) + got["idle_ms"] == pytest.approx(got["span_ms"])
    assert exposure([])["by_launch"] == []
