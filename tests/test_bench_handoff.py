"""bench/handoff.py's chain (a GPU bench of stage hand-offs): under the interpreter, the persistent launch and the
launch-per-stage arm compute the same bits, both the fp32 chain's values, and the counter meets every stage."""
from __future__ import annotations

import pytest
import torch

from g4rt.bench.handoff import BLOCK_K, BLOCK_N, chain


def _inputs(n: int, stages: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(stages, n, n, generator=g) / n ** 0.5).to(torch.bfloat16)
    y = torch.full((stages + 1, n), float("nan"), dtype=torch.bfloat16)
    y[0] = torch.randn(n, generator=g).to(torch.bfloat16)
    return w, y


@pytest.mark.parametrize("n", [BLOCK_N, 20])
def test_one_persistent_launch_equals_a_launch_a_stage_and_the_float_chain(n):
    """One column block (the interpreter runs programs in turn, so a persistent chain takes one); the launch
    arm's several-block case is the next test's."""
    stages = 3
    w, y = _inputs(n, stages, seed=n)
    count = torch.zeros(1, dtype=torch.int32)
    per_stage = chain(w, y.clone(), count, persistent=False)
    persistent = chain(w, y.clone(), count, persistent=True)
    assert torch.equal(per_stage, persistent)
    assert int(count) == stages - 1  # one program met the counter between each two stages
    ref = y[0].float()
    for s in range(stages):
        ref = (w[s].float() @ ref).to(torch.bfloat16).float()
        got = persistent[s + 1].float()
        assert not got.isnan().any()
        assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_a_launch_a_stage_over_several_column_blocks_and_a_long_k():
    n, stages = 300, 2  # 10 column blocks, K past one BLOCK_K tile, ragged at both ends
    w, y = _inputs(n, stages, seed=1)
    got = chain(w, y, torch.zeros(1, dtype=torch.int32), persistent=False)
    ref = y[0].float()
    for s in range(stages):
        ref = (w[s].float() @ ref).to(torch.bfloat16).float()
        assert (got[s + 1].float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_the_interpreter_refuses_a_persistent_chain_of_several_programs():
    w, y = _inputs(64, 2, seed=0)
    with pytest.raises(ValueError, match="one program"):
        chain(w, y, torch.zeros(1, dtype=torch.int32), persistent=True)
    with pytest.raises(ValueError, match=r"y \[S \+ 1, N\]"):
        chain(w, y[1:], torch.zeros(1, dtype=torch.int32), persistent=False)


PREFETCH_COMPILE = """
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon import language as gl
from g4rt.bench.handoff import _prefetch_chain_kernel as fn, BLOCK_K, WARPS
n, block_n, slots = (int(v) for v in sys.argv[1:])
layout = gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.bfloat16)
sig = {a: "i32" for a in fn.arg_names}
sig.update(w_desc=f"tensordesc<bf16[{block_n}, {BLOCK_K}],{layout!r}>", y_ptr="*bf16", count_ptr="*i32")
const = dict(NT=n // BLOCK_K, XP=triton.next_power_of_2(n // BLOCK_K), SLOTS=slots, BLOCK_N=block_n, BK=BLOCK_K,
             NUM_WARPS=WARPS)
sig.update({a: "constexpr" for a in const})
c = triton.compile(GluonASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": WARPS})
ptx = c.asm["ptx"]
print(json.dumps({"shared": c.metadata.shared, **{k: len(re.findall(p, ptx)) for k, p in (
    ("copies", r"cp\\.async\\.bulk\\.tensor"), ("acquire", r"ld\\.global\\.gpu\\.acquire"),
    ("release", r"red\\.global\\.gpu\\.release"))}}))
"""


@pytest.mark.parametrize("n, block_n, slots", [(2560, BLOCK_N, 1), (2048, 16, 2)])
def test_the_prefetch_arm_compiles_for_sm_90_with_its_slices_in_shared_memory(n, block_n, slots):
    """The Gluon arm has no interpreter, so CI compiles it (a subprocess without TRITON_INTERPRET): a program's
    slices of [block_n, n] come by tensor-memory copies into shared memory within what `prefetch_smem` counts and
    PREFETCH_SMEM allows, the counter's wait is an acquire load and its arrival a release add. It runs on a Hopper
    GPU only (`prefetch_takes`)."""
    import json
    import os
    import subprocess
    import sys

    from g4rt.bench.handoff import PREFETCH_SMEM, prefetch_smem

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", PREFETCH_COMPILE, str(n), str(block_n), str(slots)], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert slots * n * block_n * 2 <= got["shared"] <= prefetch_smem(n, block_n, slots) <= PREFETCH_SMEM
    assert got["copies"] >= n // BLOCK_K and got["acquire"] >= 1 and got["release"] == 1


def test_the_prefetch_arm_runs_only_where_every_program_is_resident_at_once():
    """Its programs wait for each other, so a chain that cannot hold them all on the SMs at once (or a slice past
    PREFETCH_SMEM, or partial copies) is refused, not launched into a deadlock; off a Hopper GPU it never runs."""
    from g4rt.bench.handoff import prefetch_fits, prefetch_takes

    assert prefetch_fits(2560, 32, 1, 132) and prefetch_fits(2560, 16, 1, 132)  # 80 / 160 programs, 2 an SM
    assert prefetch_fits(2048, 16, 2, 132) and not prefetch_fits(2048, 16, 2, 127)  # 128 programs, one an SM
    assert not prefetch_fits(2560, 16, 2, 132)  # 160 programs of 161 KB: one an SM
    assert not prefetch_fits(2560, 32, 2, 132)  # 321 KB a program
    assert not prefetch_fits(1000, 16, 1, 132) and not prefetch_fits(1024, 24, 1, 132)  # partial copies
    assert not prefetch_takes(1024, 16, 1)  # no Hopper GPU here (and under the interpreter never)
