"""The bench's rooflines (bench/engine.py), which every GPU number is printed beside: the bytes a decode
step really reads, and the bounds built from them and from its FLOPs."""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from conftest import tiny_config

from g4rt.bench.engine import (expert_bytes, exposure, kv_bytes_per_step, replay_context, roofline,
                              weight_bytes_per_step)
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


def test_a_profile_states_the_contexts_its_graph_replayed(e2b):
    """A decode profile replays the graph on what its last step left in the static inputs: padded rows (kv_len
    1) beside the sequences that step decoded. Below the window (8 keys in the tiny E2B) a row's KV bytes grow
    with its context alone, so rows at 3 and 7 read what two rows at 5 read; a padded row reads its one position."""
    ctx = replay_context(e2b, [3, 7, 1, 1])
    assert ctx["replay_rows"] == 2 and ctx["replay_kv_lens"] == [1, 2.0, 7]
    assert ctx["replay_kv_bytes"] == kv_bytes_per_step(e2b, 2, 5) + kv_bytes_per_step(e2b, 2, 1)
    assert replay_context(e2b, [20])["replay_kv_bytes"] < 20 * kv_bytes_per_step(e2b, 1, 1)  # the window


def e2b_matmul_params(cfg) -> int:
    """The tiny E2B's matmul weights a token runs, by hand: layers 0-3 and 5 own a sliding cache, layer 4 a
    full one, 6-8 share layer 5's and 9 layer 4's (no k/v projections, the MLP double-wide); every layer
    has q and o (heads x head dim x H each), gate/up/down (3 x I x H) and the per-layer-input gate and
    projection (2 x P x H); then the per-layer-input model projection (L x P x H) and the tied lm_head
    (V x H). The embedding and per-layer-input tables are lookups, not matmuls."""
    H, Q, kv, I, P = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                      cfg.hidden_size_per_layer_input)
    D, G, L, V = cfg.head_dim, cfg.global_head_dim, cfg.num_hidden_layers, cfg.vocab_size

    def layer(head_dim, kv_heads, mlp):
        return 2 * Q * head_dim * H + 2 * kv_heads * head_dim * H + 3 * mlp * H + 2 * P * H

    return 5 * layer(D, kv, I) + layer(G, kv, I) + 3 * layer(D, 0, 2 * I) + layer(G, 0, 2 * I) + L * P * H + V * H


def attention_flops_at(cfg, sliding: int, full: int, position: int) -> int:
    """QK^T and PV of one query at `position`, by hand: 2 x keys x head dim each per query head, the keys
    its own position and those before it, on a sliding layer at most the window."""
    Q, D, G, W = cfg.num_attention_heads, cfg.head_dim, cfg.global_head_dim, cfg.sliding_window
    return sliding * 4 * min(position + 1, W) * D * Q + full * 4 * (position + 1) * G * Q


def test_the_serial_floor_adds_the_matmuls_bound_to_the_attentions(e2b):
    """Bytes-bound at batch 1: the serial floor is the byte roofline. With a matmul rate low enough that
    the matmuls are compute-bound but the attention is not, it is the matmuls' FLOP time plus the KV
    time, above both the byte roofline and the FLOP floor, which adds the matmuls' and the attention's
    FLOPs (2 a matmul weight a token, and `attention_flops_at`: 8 sliding layers and 2 full)."""
    cfg = e2b.config
    bw = 1e6  # bytes/s: slow ceilings keep the tiny model's times clear of the records' 3-decimal rounding
    one = roofline(e2b, 1, 40, {"copy_GBps": bw / 1e9, "matmul_TFLOPs": 1.0})
    assert one["serial_floor_ms"] == one["roofline_step_ms"]
    batch, ctx = 64, 40
    w, kv = weight_bytes_per_step(e2b, batch), kv_bytes_per_step(e2b, batch, ctx)
    mm = 2.0 * e2b_matmul_params(cfg) * batch
    at = batch * attention_flops_at(cfg, sliding=8, full=2, position=ctx - 1)
    peak = mm / (1.5 * w / bw)  # FLOP/s at which the matmuls take 1.5x their weight bytes' time
    assert at / peak < kv / bw  # the attention stays bytes-bound
    r = roofline(e2b, batch, ctx, {"copy_GBps": bw / 1e9, "matmul_TFLOPs": peak / 1e12})
    assert r["serial_floor_ms"] == pytest.approx((mm / peak + kv / bw) * 1e3, rel=1e-4)
    assert r["flop_floor_ms"] == pytest.approx((mm + at) / peak * 1e3, rel=1e-4)
    assert r["serial_floor_ms"] > max(r["roofline_step_ms"], r["flop_floor_ms"])
    assert r["serial_tok_s_total"] == pytest.approx(batch / r["serial_floor_ms"] * 1e3, rel=1e-3)


def test_a_mixture_of_experts_step_reads_and_runs_only_the_experts_its_routers_pick():
    """At batch 1 a layer reads and runs its top_k experts, not all E (all E would charge a step with bytes
    it never reads); as the batch grows the distinct experts approach E, and the bytes those of every
    weight; the FLOPs grow with top_k experts a token whatever the batch."""
    moe = Gemma4Model(tiny_config("26b"), dtype=torch.bfloat16, device="meta")
    cfg = moe.config
    E, k, L = cfg.num_experts, cfg.top_k_experts, cfg.num_hidden_layers
    H, Q, I, M = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.moe_intermediate_size
    D, G, V = cfg.head_dim, cfg.global_head_dim, cfg.vocab_size
    expert = 3 * M * H  # its gate and up (M x H each) and its down (H x M)
    assert expert_bytes(moe) == 2 * expert  # bf16
    everything = sum(p.numel() * p.element_size() for p in moe.parameters())
    ceil = {"copy_GBps": 1e-3, "matmul_TFLOPs": 1e-6}
    one = roofline(moe, 1, 40, ceil)
    assert one["weight_bytes"] == everything - (E - k) * L * 2 * expert
    many = roofline(moe, 4096, 40, ceil)
    assert many["weight_bytes"] == pytest.approx(everything, rel=1e-9)
    assert one["weight_bytes"] < roofline(moe, 2, 40, ceil)["weight_bytes"] < many["weight_bytes"]
    # A token's matmul weights: per layer q and o, the dense MLP (3 x I x H), the router (E x H) and top_k
    # experts; k and v on the 5 sliding layers (2 KV heads), k alone on the full one (k_eq_v, 1 KV head);
    # and the tied lm_head (V x H).
    ffn = 3 * I * H + E * H + k * expert
    token = (5 * (2 * Q * D * H + 2 * cfg.num_key_value_heads * D * H + ffn)
             + (2 * Q * G * H + cfg.num_global_key_value_heads * G * H + ffn) + V * H)
    at = attention_flops_at(cfg, sliding=5, full=1, position=39)
    assert one["flop_floor_ms"] == pytest.approx((2 * token + at) / 1e6 * 1e3, rel=1e-3)


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
    assert exposure(runs, listed=("norm", "attn"))["listed"] == {"norm": [7.0, 8.0], "attn": []}  # in launch order


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a CUDA GPU")
@pytest.mark.parametrize("module, args", [("engine", []), ("engine", ["--shared-carveout", "100"]),
                                          ("kernels", [])])
def test_the_gpu_benches_refuse_a_machine_without_cuda_by_saying_so(module, args, tmp_path, capsys):
    """bench.engine and bench.kernels time GPU work: without CUDA they stop at the argument check with that reason
    (exit 2), before building a model, touching the driver (`--shared-carveout`) or writing into --out."""
    main = importlib.import_module(f"g4rt.bench.{module}").main
    with pytest.raises(SystemExit) as stop:
        main(["--out", str(tmp_path / "out"), *args])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_decode_steps_sampling_flags_are_checked_before_the_gpu(tmp_path, capsys):
    """bench.engine's --decode-temperature / --decode-top-k / --decode-top-p are the requests' SamplingParams:
    a bad one stops at the argument check naming the field, on any machine."""
    from g4rt.bench.engine import main

    with pytest.raises(SystemExit) as stop:
        main(["--out", str(tmp_path / "out"), "--decode-temperature", "1", "--decode-top-p", "1.5"])
    assert stop.value.code == 2 and "top_p must be in (0, 1]" in capsys.readouterr().err


def test_the_samplers_kernels_are_timed_per_call(monkeypatch):
    """`--sampler` records each kernel's GPU ms per call (`kernels_ms`): the profiled calls' sums divided by their
    count, after one warm-up call outside the profiler."""
    from g4rt.bench import kernels

    calls = []
    monkeypatch.setattr(kernels.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(kernels.torch.profiler, "profile", lambda **kw: contextlib.nullcontext())
    top = [["_sample_kernel", 0.9], ["_round_kernel", 0.3]]
    monkeypatch.setattr(kernels, "kernel_kinds", lambda prof: {"top": top})
    assert kernels._kernels_ms(lambda: calls.append(1), 3) == [["_sample_kernel", 0.3], ["_round_kernel", 0.1]]
    assert len(calls) == 4
