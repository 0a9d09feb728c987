"""Tensor parallelism (models/parallel.py, runtime/engines/parallel.py): the shard rule, sharded loading,
TP=2 over gloo on CPU against TP=1 for the four tiny variants, and ranks that fail."""
from __future__ import annotations

import json
import os
import multiprocessing
import time

import pytest
import torch
from safetensors import safe_open

import parallel_builders
from conftest import tiny_config
from g4rt.models import checkpoint
from g4rt.models.checkpoint import load_model, random_model, write_random_checkpoint
from g4rt.models.config import load_config
from g4rt.models.layout import KVLayout, PageGeometry
from g4rt.plugins.ops import HAVE_TRITON
from g4rt.models.parallel import (ParallelError, ParallelGemma4Model, check_tensor_parallel, load_rank_model,
                                  random_rank_model, rank_config, shard_plan, take_shard)
from g4rt.runtime.engines.parallel import ParallelEngine, RankSpec
from g4rt.runtime.llm import LLM
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import SchedulerConfig

VARIANTS = ("e2b", "e4b", "26b", "31b")
# Longer than the tiny window (8), prefilled in chunks of 4 beside decodes: mixed steps and sliding pages.
PROMPTS = [[2, 5, 9, 11, 3, 7, 8, 9, 10, 12, 14, 40, 41], [2, 100, 200, 300, 77], [2, 60, 61, 62, 63, 64, 65, 66, 67]]
STEPS = SchedulerConfig(max_num_batched_tokens=8, chunk=4)
FRAMES = 64


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """fp32 random checkpoints of the tiny variants ("deep" init: less repetitive greedy tokens)."""
    root = tmp_path_factory.mktemp("tp")
    return {v: write_random_checkpoint(tiny_config(v), root / v, seed=3, dtype="float32", init="deep")
            for v in VARIANTS}


def _our_processes():
    return [p for p in multiprocessing.active_children() if p.name.startswith("g4rt-tp-rank")]


# ---- the rule --------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tp", (2, 4))
def test_shards_cover_every_tensor_and_kv_heads_follow_their_queries(variant, tp):
    cfg = tiny_config(variant)
    full = ParallelGemma4Model(cfg, 1, 0, dtype=torch.float32, device="meta").state_dict()
    plans = [shard_plan(cfg, tp, r) for r in range(tp)]
    for name, (dim, _) in plans[0].items():
        taken = [i for p in plans for rng in p[name][1] for i in rng]
        n = full[name].shape[dim]
        if "k_proj" in name or "v_proj" in name:  # replicated where the heads are fewer than the ranks
            head_dim = cfg.layer_head_dim(int(name.split(".")[1]))
            assert sorted(set(taken)) == list(range(n))
            assert len(taken) == head_dim * max(n // head_dim, tp)
        else:
            assert sorted(taken) == list(range(n)), name  # a partition: each index on exactly one rank
    for kv in KVLayout.from_config(cfg).layers:
        if not kv.owns_cache:
            continue
        group = kv.num_q_heads // kv.num_kv_heads
        for p in plans:
            (q,), (k,) = p[f"layers.{kv.index}.self_attn.q_proj.weight"][1], \
                p[f"layers.{kv.index}.self_attn.k_proj.weight"][1]
            kv_heads = {i // kv.head_dim for i in k}
            assert {h // group for h in range(q.start // kv.head_dim, q.stop // kv.head_dim)} <= kv_heads


def test_check_names_the_field_that_does_not_split():
    with pytest.raises(ParallelError, match="not one of"):
        check_tensor_parallel(tiny_config("31b"), 3)
    with pytest.raises(ParallelError, match="num_attention_heads = 4"):
        check_tensor_parallel(tiny_config("31b"), 8)
    with pytest.raises(ParallelError, match="num_key_value_heads = 3"):
        check_tensor_parallel(tiny_config("31b", num_key_value_heads=3, num_attention_heads=6), 2)
    with pytest.raises(ParallelError, match="moe_intermediate_size = 30"):
        check_tensor_parallel(tiny_config("26b", moe_intermediate_size=30), 4)


def test_kv_memory_per_size_matches_design():
    """DESIGN.md §8.2's table: KV bytes stored on all ranks against TP1, and the full page size."""
    table = {"e2b": (2.0, 4.0, 8.0), "e4b": (1.0, 2.0, 4.0), "26b-a4b": (1.0, 1.09, 1.27), "31b": (1.0, 1.0, 1.09)}
    for name, ratios in table.items():
        cfg = load_config(name)
        base = KVLayout.from_config(cfg).bytes_per_token
        for tp, ratio in zip((2, 4, 8), ratios):
            layout = KVLayout.from_config(rank_config(cfg, tp))
            assert round(layout.bytes_per_token * tp / base, 2) == ratio, (name, tp)
    assert PageGeometry.build(KVLayout.from_config(rank_config(load_config("31b"), 8))).page_tokens["full"] == 80


# ---- loading ---------------------------------------------------------------------------------------

class _CountingOpen:
    """safe_open that counts the bytes of every tensor it hands out (whole or sliced); headers are free."""

    read = 0

    def __init__(self, *a, **kw):
        self.f = safe_open(*a, **kw)

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def __getattr__(self, name):  # keys(), metadata(): header reads
        return getattr(self.f, name)

    def _count(self, t):
        _CountingOpen.read += t.numel() * t.element_size()
        return t

    def get_tensor(self, name):
        return self._count(self.f.get_tensor(name))

    def get_slice(self, name):
        outer, sl = self, self.f.get_slice(name)

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, index):
                return outer._count(sl[index])
        return Slice()


@pytest.mark.parametrize("variant", ("e2b", "26b"))
def test_sharded_load_reads_only_the_rank_slices(variant, checkpoints, monkeypatch):
    monkeypatch.setattr(checkpoint, "safe_open", _CountingOpen)
    cfg = tiny_config(variant)
    whole = load_model(checkpoints[variant], dtype="float32").state_dict()
    for rank in range(2):
        _CountingOpen.read = 0
        model = load_rank_model(checkpoints[variant], 2, rank, dtype="float32")
        held = model.state_dict()
        assert _CountingOpen.read == sum(t.numel() * t.element_size() for t in held.values())
        plan = shard_plan(cfg, 2, rank)
        for name, t in held.items():
            assert torch.equal(t, take_shard(whole[name], *plan[name]) if name in plan else whole[name]), name
        assert held["layers.0.self_attn.q_proj.weight"].shape[0] == whole["layers.0.self_attn.q_proj.weight"].shape[0] // 2


def test_tp1_rank_model_is_the_plain_model(checkpoints):
    """At TP 1 the parallel modules compute exactly what the plain model does (no collective runs)."""
    outs = [LLM.paged(m, num_frames=FRAMES, config=STEPS, record_logits=True).generate(
                PROMPTS, SamplingParams(max_new_tokens=4))
            for m in (load_model(checkpoints["e2b"], dtype="float32"),
                      load_rank_model(checkpoints["e2b"], 1, 0, dtype="float32"))]
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_random_rank_model_slices_random_model():
    cfg = tiny_config("26b")
    whole = random_model(cfg, dtype=torch.float32, seed=5).state_dict()
    plan = shard_plan(cfg, 2, 1)
    for name, t in random_rank_model(cfg, 2, 1, dtype=torch.float32, seed=5).state_dict().items():
        assert torch.equal(t, take_shard(whole[name], *plan[name]) if name in plan else whole[name]), name


# ---- TP=2 over gloo against TP=1 -------------------------------------------------------------------

def _generate(engine_or_model, eos, max_new_tokens=8):
    llm = (LLM(engine_or_model, FRAMES, STEPS, eos_ids=eos, record_logits=True)
           if isinstance(engine_or_model, ParallelEngine) else
           LLM.paged(engine_or_model, num_frames=FRAMES, config=STEPS, record_logits=True))
    return llm.generate(PROMPTS, SamplingParams(max_new_tokens=max_new_tokens))


def _spec(path, tp=2, **kw):
    return RankSpec(str(path), tp, FRAMES, init_timeout_s=60, timeout_s=60, **kw)


def _assert_same(ref, out, report, label):
    worst = 0.0
    for a, b in zip(ref, out):
        assert a.token_ids == b.token_ids, label
        assert len(a.logits) == len(b.logits)
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-4)
            worst = max(worst, (x - y).abs().max().item())
    report(f"{label}: greedy tokens equal to TP1, max |logit difference| {worst:.2e}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_equals_tp1(variant, checkpoints, report):
    path = checkpoints[variant]
    ref = _generate(load_model(path, dtype="float32"), tiny_config(variant).eos_token_ids)
    with ParallelEngine(_spec(path)) as engine:
        assert engine.geometry == PageGeometry.build(KVLayout.from_config(rank_config(tiny_config(variant), 2),
                                                                          torch.float32))
        out = _generate(engine, engine.config.eos_token_ids)
    _assert_same(ref, out, report, f"tiny {variant} TP2 (gloo, 2 processes)")
    assert not _our_processes()


@pytest.mark.slow
def test_tp4_equals_tp1_with_replicated_kv_heads(checkpoints, report):
    """4 ranks, 2 KV heads: every head on two ranks; the 26B's MoE sliced four ways."""
    for variant in ("e4b", "26b"):
        path = checkpoints[variant]
        ref = _generate(load_model(path, dtype="float32"), tiny_config(variant).eos_token_ids, 4)
        with ParallelEngine(_spec(path, tp=4)) as engine:
            out = _generate(engine, engine.config.eos_token_ids, 4)
        _assert_same(ref, out, report, f"tiny {variant} TP4 (gloo, 4 processes)")


# ---- failures: a clear error, no hang --------------------------------------------------------------

def test_a_rank_that_fails_to_load_stops_the_launch(checkpoints):
    t0 = time.monotonic()
    with pytest.raises(ParallelError, match="rank 1 failed while loading(.|\n)*injected load failure on rank 1"):
        ParallelEngine(_spec(checkpoints["31b"]), build=parallel_builders.fail_loading_on_rank1)
    assert time.monotonic() - t0 < 30
    assert not _our_processes()


def test_a_rank_that_never_loads_times_out(checkpoints):
    t0 = time.monotonic()
    spec = RankSpec(str(checkpoints["31b"]), 2, FRAMES, init_timeout_s=4, timeout_s=60)
    with pytest.raises(ParallelError, match=r"rank\(s\) \[1\] did not load within 4"):
        ParallelEngine(spec, build=parallel_builders.hang_loading_on_rank1)
    assert time.monotonic() - t0 < 20
    assert not _our_processes()


@pytest.mark.parametrize("rank, build, raised, stopped", [
    (1, parallel_builders.fail_step3_on_rank1, ParallelError, "tensor-parallel rank 1 failed"),
    (0, parallel_builders.fail_step3_on_rank0, RuntimeError, "tensor-parallel rank 0 failed: RuntimeError"),
])
def test_a_rank_that_fails_mid_run_stops_every_rank(rank, build, raised, stopped, checkpoints):
    """Rank 1 failing: rank 0 raises its report. Rank 0 failing: its own error, and the workers (waiting
    inside a collective for it) are stopped. Either way the engine refuses further steps."""
    engine = ParallelEngine(_spec(checkpoints["31b"]), build=build)
    t0 = time.monotonic()
    with pytest.raises(raised, match=f"injected step failure on rank {rank}"):
        _generate(engine, engine.config.eos_token_ids)
    assert time.monotonic() - t0 < 30
    assert not _our_processes()
    with pytest.raises(ParallelError, match=f"stopped after an error; {stopped}"):
        engine.step(None)


def test_cli_generate_tensor_parallel_2(checkpoints, capsys):
    from g4rt.cli import main
    argv = ["generate", "--model", str(checkpoints["e2b"]), "--token-ids", "2,5,9,11,3,7,8,9,10,12",
            "--token-ids", "2,100,200", "--max-new-tokens", "6", "--chunk", "4", "--json"]
    runs = []
    for tp in ("1", "2"):
        assert main(argv + ["--tensor-parallel", tp]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert [o["token_ids"] for o in runs[1]["outputs"]] == [o["token_ids"] for o in runs[0]["outputs"]]
    assert runs[1]["engine"] == "eager over 2 ranks"
    assert not _our_processes()


@pytest.mark.slow
def test_tp2_compiled_engine_equals_tp1(checkpoints, report):
    """The inductor engine per rank (CPU: compiled layer pieces holding the functional all-reduces, no
    CUDA graphs) against TP1's eager engine."""
    path = checkpoints["31b"]
    ref = _generate(load_model(path, dtype="float32"), tiny_config("31b").eos_token_ids, 4)
    with ParallelEngine(_spec(path, backend="inductor")) as engine:
        out = _generate(engine, engine.config.eos_token_ids, 4)
    _assert_same(ref, out, report, "tiny 31b TP2 inductor engine (gloo, 2 processes)")


@pytest.mark.slow
def test_tp2_triton_kernels_equal_tp1(checkpoints, report):
    """The Triton kernels (interpreted) on a rank's shapes: local heads, the MoE sliced to 16 columns."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not HAVE_TRITON:
        pytest.skip("needs triton and TRITON_INTERPRET=1 before triton is imported (make test sets it)")
    path = checkpoints["26b"]
    ref = _generate(load_model(path, dtype="float32", kernels="triton"), tiny_config("26b").eos_token_ids, 4)
    with ParallelEngine(_spec(path, kernels="triton")) as engine:
        out = _generate(engine, engine.config.eos_token_ids, 4)
    _assert_same(ref, out, report, "tiny 26b TP2 Triton kernels (interpreter, gloo, 2 processes)")


def test_cli_refuses_a_split_the_model_does_not_have(checkpoints):
    from g4rt.cli import main
    with pytest.raises(SystemExit, match="tensor-parallel 8: .*num_attention_heads = 4"):
        main(["generate", "--model", str(checkpoints["31b"]), "--token-ids", "2,5", "--tensor-parallel", "8"])
    with pytest.raises(SystemExit, match="--reference runs on one device"):
        main(["generate", "--model", str(checkpoints["31b"]), "--token-ids", "2,5", "--tensor-parallel", "2",
              "--reference"])
