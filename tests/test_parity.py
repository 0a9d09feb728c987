"""The GPU parity command (`bench/parity.py`, `make gpu-parity`) on CPU: its comparison on tiny
configs, its float64 oracle, and the deep random init it relies on."""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from conftest import tiny_config

from g4rt.bench.parity import KeepFloat64, Settings, check_size, hf_logits, hf_sharing, main, rel_err
from g4rt.models.checkpoint import random_model
from g4rt.models.config import load_config

CPU = Settings(engines=("eager",), kernels=("reference",), decode=8, extra=20, chunk=16, device="cpu")


def test_tiny_passes_and_a_window_off_by_one_fails(report):
    """The command's logic end to end (fp32 engine against the fp64 oracle, HF fp32 as the yardstick),
    then the same with our sliding window W-1: the error jumps past the factor and the size fails."""
    cfg = tiny_config("e2b")
    (ok,) = check_size(cfg, "tiny-e2b", CPU, lambda r: r)
    (broken,) = check_size(cfg, "tiny-e2b", dataclasses.replace(CPU, break_window=True), lambda r: r)
    report(f"parity tiny e2b (eager, reference): error vs fp64 {ok['err_vs_fp64']:.2e}, HF fp32's "
           f"{ok['hf32_err_vs_fp64']:.2e}; window W-1: {broken['err_vs_fp64']:.2e}")
    assert ok["pass"] and ok["tokens_equal_hf32_greedy"] and ok["rows_compared"] == CPU.decode + 1
    assert ok["hf32_err_vs_fp64"] < 1e-5
    assert not broken["pass"] and broken["ratio"] > 100


def test_moe_references_follow_the_routing_and_a_wrong_choice_fails(monkeypatch, report):
    """On an MoE config the references take the arm's expert choices, so the comparison is arithmetic
    only; an arm whose router drops its best expert for the (k+1)-th is caught by the routing margin
    even though the references follow it."""
    from g4rt.models import blocks

    cfg = tiny_config("26b")
    (ok,) = check_size(cfg, "tiny-26b", CPU, lambda r: r)
    assert ok["pass"] and ok["routing"]["differ_from_oracle"] == 0
    assert ok["routing"]["choices"] == cfg.num_hidden_layers * (2 * cfg.sliding_window + CPU.extra + CPU.decode)

    def second_best(logits, per_expert_scale, top_k):
        w, idx = blocks.route(logits, per_expert_scale, top_k + 1)
        return w[:, 1:] / w[:, 1:].sum(-1, keepdim=True), idx[:, 1:]

    monkeypatch.setitem(blocks.REFERENCE, "route", second_best)
    (bad,) = check_size(cfg, "tiny-26b", CPU, lambda r: r)
    report(f"parity tiny 26b: routing margin {ok['routing']['max_margin']:.1e}; dropping the best expert "
           f"{bad['routing']['max_margin']:.2f} (tol {bad['routing']['tol']:.0e}), error vs fp64 {bad['err_vs_fp64']:.1e}")
    assert not bad["pass"] and bad["routing"]["max_margin"] > 100 * CPU.routing_tol


def _whole_model_fp64(hf):
    """A deep copy of `hf` in float64, its RoPE tables left in fp32 (as every implementation builds them)."""
    hf64 = copy.deepcopy(hf).double()
    rope = hf64.model.rotary_emb
    for name, b in rope._buffers.items():
        rope._buffers[name] = b.float()
    return hf64


@torch.inference_mode()
def _incremental(hf64, ids: list[int], rows: int, keep: bool) -> torch.Tensor:
    """HF's own with-cache path: prefill, then one token per step; the last `rows` logits."""
    with KeepFloat64() if keep else contextlib.nullcontext():
        out = hf64(input_ids=torch.tensor([ids[:-rows + 1]]), use_cache=True)
        cache, logits = out.cache, [out.logits[0, -1]]
        for t in ids[-rows + 1:]:
            out = hf64(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


def test_oracle_is_float64_accurate():
    """The streamed oracle equals the whole model in float64, and HF's own prefill + decode path agrees
    with it to float64 rounding; without KeepFloat64, HF's fp32 casts leave "float64" far off that."""
    model = random_model(tiny_config("31b"), torch.float32, "cpu", seed=4, init="deep")
    hf = hf_sharing(model)
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    streamed, kept = hf_logits(hf, ids, 6, float64=True)
    hf64 = _whole_model_fp64(hf)
    with torch.inference_mode(), KeepFloat64():
        whole = hf64(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=6).logits[0]
    assert kept > 0 and torch.equal(streamed, whole)
    assert rel_err(_incremental(hf64, ids, 6, keep=True), streamed) < 1e-12
    assert rel_err(_incremental(hf64, ids, 6, keep=False), streamed) > 1e-9


def _narrow(size: str, window: int = 16):
    """A published size at full depth (layer pattern, KV sharing, MoE, PLE) at a CPU-sized width."""
    c = load_config(size)
    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=4096, vocab_size_per_layer_input=4096, sliding_window=window)
    if c.num_global_key_value_heads:
        kw["num_global_key_value_heads"] = 1
    if c.hidden_size_per_layer_input:
        kw["hidden_size_per_layer_input"] = 64
    if c.enable_moe_block:
        kw.update(num_experts=16, top_k_experts=4, moe_intermediate_size=128)
    return dataclasses.replace(c, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["e2b", "31b"])
def test_deep_init_is_not_chaotic_at_full_depth(size, report):
    """HF fp32 against HF fp64 at full depth: the default init is chaotic (rounding grows layer by
    layer into order-one differences), the deep init keeps them near fp32 rounding and greedy choices
    varied."""
    cfg = _narrow(size)
    ids = torch.randint(3, cfg.vocab_size, (2 * cfg.sliding_window + 40,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    errs = {}
    for init in ("default", "deep"):
        hf = hf_sharing(random_model(cfg, torch.float32, "cpu", seed=0, init=init))
        ref, _ = hf_logits(hf, ids, 17, float64=True)
        errs[init] = rel_err(hf_logits(hf, ids, 17)[0], ref)
    report(f"HF fp32 vs fp64, narrow {size} at {cfg.num_hidden_layers} layers: default init {errs['default']:.2e}, "
           f"deep init {errs['deep']:.2e}")
    assert errs["default"] > 1e-2 and errs["deep"] < 1e-5
    assert len(set(ref.argmax(-1).tolist())) > 8


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="init"):
        random_model(tiny_config("31b"), torch.float32, "cpu", init="shallow")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--engines", "eager,onnx"])
    with pytest.raises(ValueError, match="--kernels"):
        main(["--out", str(tmp_path), "--kernels", "cuda"])


@pytest.mark.slow
def test_command_exit_status(tmp_path):
    """The command itself: two sizes, one fresh process each (side by side), pass (exit 0); one size with the window
    off by one fails (exit 1). Each run appends its records to DIR/parity.jsonl."""
    import json

    from g4rt.models.checkpoint import hf_config_dict

    dirs = []
    for v in ("e4b", "26b"):
        d = tmp_path / v
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf_config_dict(tiny_config(v), "float32")))
        dirs.append(str(d))
    common = ["--device", "cpu", "--engines", "eager", "--kernels", "reference", "--decode", "4", "--extra", "10",
              "--chunk", "16"]
    assert main(["--out", str(tmp_path / "ok"), "--sizes", ",".join(dirs), "--memory-gib", "1000", *common]) == 0
    assert main(["--out", str(tmp_path / "broken"), "--sizes", dirs[0], "--break-window", *common]) == 1
    records = [json.loads(line) for line in (tmp_path / "ok" / "parity.jsonl").read_text().splitlines()]
    assert records[-1] == {"stage": "summary", "exit_codes": dict.fromkeys(dirs, 0), "pass": True}
    assert sum(r.get("stage") == "arm" and r["pass"] for r in records) == 2


def test_sizes_run_side_by_side_only_while_their_planned_memory_fits(monkeypatch):
    """`run_sizes` starts a size once the running ones' plan plus its own fits `memory_gib`, in order;
    with 0 one at a time."""
    from g4rt.bench import parity

    live, peaks, started = set(), [], []

    class Proc:
        def __init__(self, cmd):
            self.name, self.polls = cmd[-1], 0
            live.add(self.name)
            started.append(self.name)
            peaks.append(set(live))

        def poll(self):
            self.polls += 1
            if self.polls < 2:
                return None
            live.discard(self.name)
            self.returncode = 1 if self.name == "c" else 0
            return self.returncode

    monkeypatch.setattr(parity.subprocess, "Popen", Proc)
    monkeypatch.setattr(parity.time, "sleep", lambda s: None)
    plan = {"a": 30.0, "b": 40.0, "c": 100.0}
    assert parity.run_sizes([], ["a", "b", "c"], plan, 130) == {"a": 0, "b": 0, "c": 1}
    assert started == ["a", "b", "c"] and {"a", "b"} in peaks and all(len(p) == 1 for p in peaks if "c" in p)
    peaks.clear()
    parity.run_sizes([], ["a", "b", "c"], plan, 0)
    assert all(len(p) == 1 for p in peaks)
