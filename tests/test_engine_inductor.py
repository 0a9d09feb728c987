"""The inductor engine's compiled step against the eager step, on CPU (CUDA-graph decode needs a GPU
and is exercised by bench/engine.py on the H200)."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from fixtures import eager_and_compiled

from g4rt.models.checkpoint import random_model
from g4rt.models.layout import PageGeometry
from g4rt.runtime.arena import Arena
from g4rt.runtime.engines.eager import EagerEngine
from g4rt.runtime.engines.inductor import DecodeInputs, InductorEngine, _with_compiled_layers
from g4rt.runtime.pages import FramePool
from g4rt.runtime.sampling import SamplingParams
from g4rt.runtime.scheduler import Scheduler, SchedulerConfig


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layers", "step"])
def test_compiled_bf16_step_matches_eager(scope, report):
    """A dense k_eq_v model in bf16 with the torch reference blocks, compiled by Inductor, against eager.

    Not bit-equal: Inductor fuses the reference RMSNorm into a reduction of its own that sums in another
    order, so some bf16 K/V rows land one ulp apart. What must hold: the same K/V rows written (to bf16
    rounding) and close logits. (With the plugin kernels, as on CUDA, the next test asks for bits.)"""
    model = random_model(tiny_config("31b", dtype="bfloat16"), torch.bfloat16, "cpu", seed=3)
    eager, eager_arena, out, compiled = eager_and_compiled(model, scope)
    assert out.shape == eager.shape and torch.isfinite(out).all()
    rel = ((out - eager).norm() / eager.norm()).item()
    report(f"compiled ({scope}) vs eager bf16 logits, torch reference blocks: relative difference {rel:.2e}")
    assert rel < 2e-2
    written = eager_arena.tensor != 0
    assert torch.equal(compiled.arena.tensor != 0, written)  # the same slots written, nothing else
    assert torch.allclose(compiled.arena.tensor.float(), eager_arena.tensor.float(), rtol=2e-2, atol=2e-2)
    # The engine compiled a copy: the caller's model still runs eager.
    assert all("attention_inputs" not in vars(layer) for layer in model.layers)


@pytest.mark.slow
@pytest.mark.parametrize("name,packed,kv_dtype", [("31b", False, None), ("31b", True, None), ("e2b", True, None),
                                                  ("e2b", True, "float8_e4m3fn")])
def test_compiled_step_is_bit_equal_with_plugin_kernels(name, packed, kv_dtype, report):
    """With the plugin kernels (what CUDA runs: RMSNorm, the fused layer tails, gated GELU and attention as
    opaque ops, here under the Triton interpreter) and, as on CUDA, q/k/v and gate/up packed, the
    per-layer compiled step computes eager's bits: logits and every K/V element. This is what lets the
    H200 run demand identical greedy tokens. The E2B-like model adds the PLE blocks and KV-shared layers;
    `kv_dtype` a one-byte KV arena under the bf16 weights."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from g4rt.plugins import launch
    if not launch.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (make test sets it)")
    model = random_model(tiny_config(name, dtype="bfloat16"), torch.bfloat16, "cpu", seed=3, kernels="triton",
                         kv_dtype=kv_dtype)
    if packed:
        model.pack_weights()
    eager, eager_arena, out, compiled = eager_and_compiled(model, "layers")
    assert compiled.arena.tensor.dtype == eager_arena.tensor.dtype == (torch.float8_e4m3fn if kv_dtype else torch.bfloat16)
    report(f"tiny {name}: compiled (layers) vs eager bf16, plugin kernels, packed weights {packed}, KV "
           f"{model.layout.dtype}: logits bit-equal {torch.equal(out, eager)}")
    assert torch.equal(out, eager)
    assert torch.equal(compiled.arena.tensor.view(torch.uint8), eager_arena.tensor.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("name,scope", [("e2b", "layers"), ("31b", "layers"), ("e2b", "step")])
def test_a_packed_decode_step_norms_writes_and_attends_in_the_attention_launch(name, scope, monkeypatch):
    """A decode step of the E2B-like model (KV-shared layers) and the 31B-like one (k_eq_v full layers) with the plugin
    kernels and packed q/k/v (as on CUDA): every layer's attention launch takes its projection (its q norms and RoPE,
    and on cache-owning layers the KV write, inside it), and the step computes the bits of the same step whose layers
    run the q/k/v norm kernel first, in the eager and the compiled engine (its layers' pieces, or the whole step
    traced through the fused op): logits and arena. The fused launch is a decode cut over its keys; the tiny model's
    few keys are cut in two here (a run may be one key, two runs at most)."""
    pytest.importorskip("triton", reason="the triton extra is not installed")
    from g4rt.models import paged
    from g4rt.plugins import launch
    from g4rt.plugins import triton_attention as ta
    from g4rt.plugins import triton_kv_write as tkv
    if not launch.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (make test sets it)")
    model = random_model(tiny_config(name, dtype="bfloat16"), torch.bfloat16, "cpu", seed=3, kernels="triton")
    model.pack_weights()
    geometry = PageGeometry.build(model.layout, page_tokens=4)
    sched = Scheduler(geometry, FramePool(32), SchedulerConfig(max_num_batched_tokens=64, chunk=64))
    for prompt in (list(range(3, 40)), list(range(50, 61))):
        sched.add(prompt, SamplingParams(max_new_tokens=3), ())
    prefill = sched.schedule()
    sched.commit(prefill, [7, 9])
    decode = sched.schedule().batch
    assert decode.num_tokens == 2 == decode.kv_lens.shape[0]
    monkeypatch.setattr(ta, "SPLIT_MIN_ELEMS", 1)
    monkeypatch.setattr(ta, "MAX_DECODE_SPLITS", 2)
    launches = []
    real = tkv.paged_attention  # the attention launches of kv_write_attention_ and projected_attention_
    monkeypatch.setattr(tkv, "paged_attention", lambda *a, **kw: launches.append(kw.get("norms")) or real(*a, **kw))

    def run(engine_of):
        arena = Arena.for_geometry(geometry, 32)
        engine = engine_of(arena)
        engine.step(prefill.batch)
        launches.clear()
        with torch.inference_mode():
            return engine.step(decode), arena.tensor.clone()

    eager = run(lambda arena: EagerEngine(model, geometry, arena))
    assert len(launches) == model.config.num_hidden_layers and all(n is not None for n in launches)
    compiled = InductorEngine(model, geometry, 32, compile_mode="default", compile_scope=scope)
    launches.clear()
    with torch.inference_mode():
        compiled.compiled(*prefill.batch.tensors())
        out = compiled.compiled(*decode.tensors())
    assert all(n is not None for n in launches[-model.config.num_hidden_layers:])
    monkeypatch.setattr(paged.PagedStep, "attention_over", lambda self, arena, cu_q, kv_lens, *groups: (
        paged.StepAttention(self, arena, cu_q, kv_lens, self._groups(kv_lens, *groups))))
    unfused = run(lambda arena: EagerEngine(model, geometry, arena))
    assert not any(n is not None for n in launches)
    assert torch.equal(eager[0], unfused[0]) and torch.equal(eager[1], unfused[1])
    assert torch.equal(out, eager[0]) and torch.equal(compiled.arena.tensor, eager[1])


def test_layers_of_one_shape_share_compiled_graphs():
    """18 layers of two shapes (sliding, full) compile to 2 pieces x 2 shapes = 4 graphs, and one more for the
    first layer's attention_inputs (no residual step of a layer before it to form). Were a piece to read the layer
    index, Dynamo would recompile per layer and, past its limit of 8, silently run the rest eager."""
    from torch._dynamo.utils import counters

    from conftest import F, S
    from g4rt.models.linear_cache import LinearCache

    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_config("31b", dtype="bfloat16", num_hidden_layers=18, layer_types=(S, S, S, S, S, F) * 3)
    model = random_model(cfg, torch.bfloat16, "cpu", seed=3)
    view = _with_compiled_layers(model, "default")
    ids = torch.arange(3, 20)
    with torch.inference_mode():
        cache = LinearCache()
        cache.begin_step([0], [len(ids)])
        view(ids, torch.arange(len(ids)), cache)
    assert counters["stats"]["unique_graphs"] == 5
    assert counters["frames"]["ok"] == counters["frames"]["total"] == 5


def test_kv_shared_layers_stay_compiled_in_decode():
    """The E4B's layers are of 5 kinds (the first, sliding, full, and KV-shared sliding and full), each compiled for
    one row and for more: 10 compiles of `attention_inputs`, past Dynamo's default limit of 8, beyond which Dynamo
    runs the KV-shared layers' decode eager. The engine raises the limit to what the model needs; a prefill and a
    one-row decode then compile every piece and run nothing eager."""
    from torch._dynamo.utils import counters

    from g4rt.bench.common import compile_health
    from g4rt.models.linear_cache import LinearCache
    from g4rt.runtime.engines.inductor import ROW_CLASSES, layer_kinds

    torch._dynamo.reset()
    counters.clear()
    default = torch._dynamo.config.recompile_limit
    model = random_model(tiny_config("e4b", dtype="bfloat16"), torch.bfloat16, "cpu", seed=3)
    assert layer_kinds(model) == 5
    try:
        view = _with_compiled_layers(model, "default")
        assert torch._dynamo.config.recompile_limit == max(default, ROW_CLASSES * 5)
        ids = torch.arange(3, 20)
        with torch.inference_mode():
            cache = LinearCache()
            cache.begin_step([0], [len(ids)])
            view(ids, torch.arange(len(ids)), cache)
            cache.begin_step([0], [1])
            view(torch.tensor([5]), torch.tensor([len(ids)]), cache)
    finally:
        torch._dynamo.config.recompile_limit = default
    # attention_inputs: 5 kinds x 2 row classes; after_attention: sliding and full x 2
    assert compile_health() == {"dynamo_frames_ok": 14, "dynamo_frames": 14, "recompile_limit_hits": 0}


def test_decode_padding_to_a_bucket_changes_nothing_real():
    """The CUDA-graph decode path pads a step to a bucket (here 3 sequences to 4, tables to 8 columns)
    with dummy rows (DecodeInputs). Run eagerly on CPU: the real rows' logits match the unpadded step's
    and the dummy rows write nothing into the arena."""
    from g4rt.models.paged import PagedStep

    model = random_model(tiny_config("31b"), torch.float32, "cpu", seed=4)
    geometry = PageGeometry.build(model.layout, page_tokens=4)
    sched = Scheduler(geometry, FramePool(32), SchedulerConfig(max_num_batched_tokens=64, chunk=64))
    for n in (9, 14, 5):
        sched.add(list(range(3, 3 + n)), SamplingParams(max_new_tokens=3), ())
    arena = Arena.for_geometry(geometry, 32)
    step = PagedStep(model, geometry)
    prefill = sched.schedule()
    with torch.inference_mode():
        step(arena.tensor, *prefill.batch.tensors())
    sched.commit(prefill, [7, 8, 9])
    decode = sched.schedule().batch
    assert decode.num_tokens == decode.num_seqs == 3 and decode.full_table.shape[1] < 8
    padded = DecodeInputs(4, 8, 8)
    padded.flat.fill_(-3)  # whatever an earlier step left: fill writes every element
    padded.fill(decode)
    other = DecodeInputs(4, 8, 8)
    other.flat.fill_(7)
    other.fill(decode)
    assert torch.equal(padded.flat, other.flat)
    before = arena.tensor.clone()
    with torch.inference_mode():
        want = step(arena.tensor.clone(), *decode.tensors())
        after = arena.tensor.clone()
        got = step(after, *padded.views)
        unpadded_arena = arena.tensor.clone()
        step(unpadded_arena, *decode.tensors())
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    # The dummy row wrote nothing: the same elements changed as without it (CPU matmuls round a 4-row
    # batch differently from a 3-row one, so the values are close, not equal).
    assert torch.equal(after != before, unpadded_arena != before) and (after != before).any()
    torch.testing.assert_close(after, unpadded_arena, rtol=1e-5, atol=1e-5)


def test_the_profile_sorts_kernels_by_what_they_do():
    """bench/common.py `kernel_kinds`, which the H200 profiles report by: each of our Triton kernels and
    Inductor's and cuBLAS's under its own kind, host events left out, counts and times summed."""
    from types import SimpleNamespace

    from g4rt.bench.common import kernel_kinds
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, us, device=cuda):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))

    def profile(*events):
        return SimpleNamespace(events=lambda: list(events))

    names = {"_paged_attn_kernel": "attention", "_combine_kernel": "attention", "_kv_write_kernel": "kv_write",
             "_add_rms_norm_kernel": "rms_norm", "_rms_norm_kernel": "rms_norm", "_router_inputs_kernel": "rms_norm",
             "_normed_sum_kernel": "rms_norm", "_qkv_norm_rope_kernel": "norm_rope",
             "_gelu_tanh_mul_kernel": "gelu_mul", "triton_poi_fused_add_0": "inductor_fused",
             "nvjet_tst_128x64_64x4": "matmul", "_gemv_kernel": "matmul", "memcpy32_post": "other"}
    for name, kind in names.items():
        assert kernel_kinds(profile(event(name, 2.0)))["by_kind"] == {kind: {"count": 1, "ms": 0.002}}, name
    kinds = kernel_kinds(profile(*(event(n, 2.0) for n in names), event("aten::add", 9.0, cpu)))
    assert kinds["by_kind"]["rms_norm"] == {"count": 4, "ms": 0.008}
    assert kinds["kernels"] == len(names) and kinds["kernel_ms"] == round(2.0 * len(names) / 1e3, 3)


def test_the_profile_finds_where_the_gpu_idled():
    """bench/engine.py `kernel_gaps`: overlapping kernels (two streams) leave no gap; the idle time is the
    span less the kernels' union, and the longest gap is named by the kernels around it."""
    from types import SimpleNamespace

    from g4rt.bench.engine import kernel_gaps
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("c", 150.0, 160.0), event("a", 0.0, 100.0), event("b", 50.0, 120.0),
              event("host", 120.0, 150.0, cpu), event("d", 1160.0, 1200.0)]
    got = kernel_gaps(SimpleNamespace(events=lambda: events), top=1)
    assert got["span_ms"] == 1.2 and got["idle_ms"] == round((30.0 + 1000.0) / 1e3, 3)
    assert got["gaps"] == [[1.0, "c", "d"]]
    assert kernel_gaps(SimpleNamespace(events=lambda: []))["span_ms"] == 0.0


def test_the_host_profile_says_what_ran_before_the_first_kernel():
    """bench/engine.py `host_edges`: the host time from the region's start to the first GPU event and from
    the last GPU event to the region's end, and the CPU ops by self time that started before the first."""
    from types import SimpleNamespace

    from g4rt.bench.engine import host_edges
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cpu, self_us=0.0):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               self_cpu_time_total=self_us)

    events = [event("region", 0.0, 5000.0), event("schedule", 100.0, 1100.0, self_us=1000.0),
              event("aten::copy_", 1200.0, 1300.0, self_us=100.0), event("aten::copy_", 1400.0, 1500.0, self_us=100.0),
              event("kernel", 2000.0, 4000.0, cuda), event("late", 2500.0, 2600.0, self_us=50.0),
              event("memcpy", 4000.0, 4500.0, cuda)]
    got = host_edges(SimpleNamespace(events=lambda: events), "region", top=2)
    assert got == {"before_gpu_ms": 2.0, "after_gpu_ms": 0.5,
                   "host_top_before_gpu": [["schedule", 1.0], ["aten::copy_", 0.2]]}
    assert host_edges(SimpleNamespace(events=lambda: events[1:]), "region")["before_gpu_ms"] is None
