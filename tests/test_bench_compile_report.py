"""bench/compile_report.py: the paged attention kernels compiled for sm_90 on this machine (no GPU; compiled,
so not under the interpreter, in a subprocess without TRITON_INTERPRET): the report's registers and shared
memory are ptxas's and the compiler's. The head-dim-512 prefill default is the Gluon kernel, which fits an
H200 with both matmuls over two warpgroups side by side; the Triton kernel it replaces there (`wgmma` false)
fits too and copies its interior tiles by tensor-memory copies; a sliding layer never does. This is what CI
checks of the Gluon kernel, which has no interpreter: its numerics run on a Hopper GPU only
(tests/test_plugins_gluon.py)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the triton extra is not installed")

H200_SMEM_BYTES = 232448  # 227 KB of shared memory per block on sm_90 (the opt-in maximum)


FULL = ["--head-dim", "512", "--page", "160", "--q-heads", "32", "--kv-heads", "4"]  # the 31B's full layer


def run(*args, interpret=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "g4rt.bench.compile_report", *args],
                          capture_output=True, text=True, timeout=600, env=env)


def report(tmp_path, *args):
    r = run(*args, "--ir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_full_layers_prefill_default_is_the_gluon_kernel_and_fits(tmp_path):
    out = report(tmp_path, *FULL)
    assert out["kernel"] == "_paged_attn_wgmma_kernel" and out["tma"] and out["arch"] == "sm_90"
    assert 0 < out["registers"] <= 255 and 0 < out["shared"] <= H200_SMEM_BYTES
    ttgir = (tmp_path / "attention.ttgir").read_text()
    assert "async_tma_copy_global_to_local" in ttgir
    assert ttgir.count("ttng.warp_group_dot ") >= 2
    # scores: 16 of a tile's 32 keys a warpgroup; output: 256 of the 512 columns; no other MMA layout
    assert sorted(set(re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = (\[[^]]*\]), instrShape = (\[[^]]*\])", ttgir))) \
        == [("[4, 2]", "[16, 16, 16]"), ("[4, 2]", "[16, 256, 16]")]
    assert ".entry _paged_attn_wgmma_kernel" in (tmp_path / "attention.ptx").read_text()


def test_the_triton_kernel_at_head_dim_512_fits_and_copies_by_tensor_memory(tmp_path):
    out = report(tmp_path, *FULL, "--config", '{"wgmma": false}')
    assert out["kernel"] == "_paged_attn_kernel" and out["tma"] and out["config"]["dv_split"] == 2
    assert 0 < out["registers"] <= 255 and 0 < out["shared"] <= H200_SMEM_BYTES
    ttgir = (tmp_path / "attention.ttgir").read_text()
    assert "async_tma_copy_global_to_local" in ttgir and "warp_group_dot" in ttgir
    assert ".entry _paged_attn_kernel" in (tmp_path / "attention.ptx").read_text()


def test_a_sliding_layer_and_an_explicit_override_keep_the_element_loads(tmp_path):
    for name, args in (("sliding", ["--head-dim", "256", "--page", "16", "--q-heads", "32", "--kv-heads", "16",
                                    "--window"]),
                       ("override", [*FULL, "--config", '{"tma": false, "wgmma": false}'])):
        out = report(tmp_path / name, *args)
        assert not out["tma"] and 0 < out["shared"] <= H200_SMEM_BYTES
        assert "async_tma_copy_global_to_local" not in (tmp_path / name / "attention.ttgir").read_text()


def test_a_one_byte_arena_widens_each_pair_to_fp16_in_one_conversion(tmp_path):
    """`--kv-dtype float8_e4m3fn`: the 31B's sliding decode at a serving batch (group 2) takes the `fma` tile (8 keys,
    one warp): fp32 products on the CUDA cores, no MMA, no spills, each pair of elements widened by one
    `cvt.rn.f16x2.e4m3x2`, its own rows written through satfinite e4m3 conversions. A group of 4 takes the e4m3
    MMA tile (16 keys, 2 warps, 3 stages) with fp16 MMAs, no bf16 ones. The full layer's prefill keeps the Triton
    kernel."""
    decode = ("--head-dim", "256", "--page", "16", "--q-heads", "32", "--decode", "--programs-per-sm", "8", "--write",
              "--norm", "--window", "--kv-dtype", "float8_e4m3fn")
    out = report(tmp_path / "fma", *decode, "--kv-heads", "16")
    cfg = out["config"]
    assert (cfg["rows"], cfg["block_n"], cfg["num_warps"], cfg.get("fma")) == (1, 8, 1, True)
    assert out["spill_bytes"] == 0 and 0 < out["registers"] <= 255
    ptx = (tmp_path / "fma" / "attention.ptx").read_text()
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mma.sync" not in ptx and "fma.rn.f32" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    out = report(tmp_path / "mma", *decode, "--kv-heads", "8")
    cfg = out["config"]
    assert (cfg["block_n"], cfg["num_warps"], cfg["num_stages"]) == (16, 2, 3) and 0 < out["registers"] <= 255
    ptx = (tmp_path / "mma" / "attention.ptx").read_text()
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.bf16.f16" not in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx and ".f32.bf16.bf16.f32" not in ptx
    assert report(tmp_path / "full", *FULL, "--kv-dtype", "float8_e4m3fn")["kernel"] == "_paged_attn_kernel"


def test_each_loops_instructions_are_counted_from_the_disassembly(tmp_path):
    """`loop_instructions`: a backward branch's span in the SASS listing, in address order (a self-branch, the exit
    trap, is no loop). The fma decode's three key loops (masked, interior, masked) hold at least its 256 fp32
    products a lane (2 heads x 8 keys x 256 columns, twice, over 32 lanes); `--ir` keeps the listing."""
    from g4rt.bench.compile_report import loop_instructions
    listing = "\n".join(f"        /*{a:04x}*/   {op} ;" for a, op in (
        (0x10, "MOV R1, c[0x0][0x28]"), (0x20, "FFMA R2, R3, R4, R2"), (0x30, "FADD R2, R2, R5"),
        (0x40, "@!P0 BRA 0x20"), (0x50, "EXIT"), (0x60, "BRA 0x60")))
    assert loop_instructions(listing) == [3]
    out = report(tmp_path, "--head-dim", "256", "--page", "16", "--q-heads", "32", "--kv-heads", "16", "--decode",
                 "--programs-per-sm", "8", "--window")
    assert out["config"].get("fma") and len(out["loop_instructions"]) == 3
    assert min(out["loop_instructions"]) > 256 and "FFMA" in (tmp_path / "attention.sass").read_text()


def test_a_register_cap_reaches_ptxas(tmp_path):
    """`maxnreg` in a tile's config (the sweeps' fifth element) caps the registers a thread of the compiled kernel."""
    decode = ("--head-dim", "256", "--page", "16", "--q-heads", "32", "--kv-heads", "16", "--decode",
              "--programs-per-sm", "8")
    free = report(tmp_path / "free", *decode)["registers"]
    assert free > 96 and report(tmp_path / "cap", *decode, "--config", '{"maxnreg": 96}')["registers"] <= 96


def test_the_samplers_kernels_are_compiled_as_sample_launches_them(tmp_path):
    """`--sampler`: a JSON line for each kernel `sample()` launches, the split ones at --chunks chunks a row (SP the
    next power of two, the pivot's groups `pivot_groups`) and the row's kernel staged and alone, each with its loops.
    Both keep the whole-row cut (a loop over digits around a pass each), race and rounds (a loop around a pass)
    for rows whose gathered entries overflow, and the staged one the same loops over a list for rows whose entries
    overflow its registers, and the row's own listing (digits again, and a listing pass) for rows the gathering
    pass left without a list; where the alone one runs the first pass over the row (a loop as long as the split
    first pass's), the staged one's first loop is the gathered entries' top-p rounds in registers, a fraction of a
    tile's work. The gathering pass loads its next tile while it counts this one's."""
    from g4rt.plugins.triton_sampling import SPLIT_ROUNDS, pivot_groups

    r = run("--sampler", "--chunks", "5", "--ir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [x["kernel"] for x in lines] == ["_first_pass_kernel", "_gather_kernel", *["_round_kernel"] * SPLIT_ROUNDS,
                                            "_sample_kernel", "_sample_kernel"]
    assert lines[1]["constexprs"]["SP"] == 8 and lines[1]["constexprs"]["G"] == pivot_groups(5, 2048) == 512
    assert all(x["registers"] and x["loop_instructions"] for x in lines)
    first, (staged, alone) = lines[0]["loop_instructions"][0], (x["loop_instructions"] for x in lines[-2:])
    assert len(alone) == 6 and len(staged) == 1 + 3 + 2 * (len(alone) - 1)
    assert abs(alone[0] - first) < 0.1 * first and staged[0] < first / 3
    assert (tmp_path / f"sampler{len(lines) - 1}__sample_kernel.sass").exists()
    # the gathering pass's key loop in two stages: its next tile copied to shared memory while this one is counted
    assert "LDGSTS" in (tmp_path / "sampler1__gather_kernel.sass").read_text() and lines[1]["shared"] >= 4 * 2048
    assert run("--sampler", "--chunks", "1").returncode == 2


def test_a_bad_config_and_the_interpreter_are_named():
    r = run(*FULL, "--config", "{rows: 64}")
    assert r.returncode == 2 and "--config is not JSON" in r.stderr
    r = run(*FULL, interpret=True)
    assert r.returncode == 2 and "TRITON_INTERPRET is set" in r.stderr


def test_a_decode_that_writes_its_keys_stores_them_then_syncs_before_its_tiles(tmp_path):
    """The decode launch that writes the step's K/V rows (`--write`): compiled for sm_90, the rows' stores come
    before a barrier of the block and every tile copy after it (a copy before it could miss the own key's row),
    and without `--write` the kernel stores nothing before its tiles."""
    e2b = ["--head-dim", "256", "--page", "16", "--q-heads", "8", "--kv-heads", "1", "--decode", "--splits", "4",
           "--window"]
    out = report(tmp_path, *e2b, "--write")
    assert 0 < out["registers"] <= 255
    ptx = (tmp_path / "attention.ptx").read_text().splitlines()
    first = lambda op: next(i for i, line in enumerate(ptx) if op in line)  # noqa: E731
    stores = [i for i, line in enumerate(ptx) if "st.global" in line]
    copies = [i for i, line in enumerate(ptx) if "cp.async" in line and "prefetch" not in line]  # tiles, not L2 asks
    assert len(stores) >= 2 and copies and max(stores[:2]) < first("bar.sync") < min(copies)
    report(tmp_path, *e2b)
    ptx = (tmp_path / "attention.ptx").read_text().splitlines()
    assert not any("st.global" in line for line in ptx[:min(i for i, line in enumerate(ptx)
                                                         if "cp.async" in line and "prefetch" not in line)])
    r = run(*e2b[:-4], "--write")
    assert r.returncode == 2 and "only a decode launch" in r.stderr


def test_a_decode_reads_its_first_key_tile_before_its_wait(tmp_path):
    """A decode launch (the E2B's sliding layer at batch 1, four splits) asks for its split's first K tile, and
    L2 for its V, before it waits for the kernel before it, and for the query's own key, q and V after; a prefill
    launch reads nothing before its wait."""
    def loads(*args):
        report(tmp_path, *args)
        ptx = (tmp_path / "attention.ptx").read_text()
        wait = ptx.index("griddepcontrol.wait")
        return ptx[:wait], ptx[wait:]

    before, after = loads("--head-dim", "256", "--page", "16", "--q-heads", "8", "--kv-heads", "1", "--window",
                          "--decode", "--splits", "4")
    assert before.count("ld.global.v4") >= 8  # the K tile: 64 keys x 256, 16 bytes a load
    assert "cp.async.bulk.prefetch.L2" in before  # and its V asked of L2
    assert after.count("ld.global.v4") >= 3 * 8  # the own key's row of that tile, its V and q
    before, _ = loads("--head-dim", "256", "--page", "16", "--q-heads", "8", "--kv-heads", "1", "--window")
    assert "ld.global" not in before


def test_a_decode_attention_waits_before_it_lets_the_next_launch_in(tmp_path):
    """The early tile's reads before the wait are safe because the attention launch of the layer before lets the next
    launch in only after its own wait, so every launch before that one has ended: compiled for sm_90, with and
    without the write and the norms, the decode kernel's trigger comes after its wait."""
    e2b = ["--head-dim", "256", "--page", "16", "--q-heads", "8", "--kv-heads", "1", "--window", "--decode",
           "--splits", "4"]
    for extra in ((), ("--write", "--norm")):
        report(tmp_path, *e2b, *extra)
        ptx = (tmp_path / "attention.ptx").read_text()
        assert 0 <= ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents"), extra


COMBINE = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from g4rt.plugins.triton_attention import _combine_kernel as fn
sig = {"ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32", "out_ptr": "*bf16", "num_splits": "i32", "D": "constexpr",
       "BLOCK_S": "constexpr", "PDL": "constexpr"}
c = triton.compile(ASTSource(fn, sig, constexprs={"D": 256, "BLOCK_S": 8, "PDL": True}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
ptx = c.asm["ptx"]
print(json.dumps({"trigger": ptx.find("griddepcontrol.launch_dependents"), "wait": ptx.find("griddepcontrol.wait"),
                  "first_load": min(m.start() for m in re.finditer(r"ld\\.global", ptx))}))
"""


def test_the_combine_launch_lets_the_next_in_before_it_waits_and_reads_after():
    """The merge of a split decode (the E2B's sliding layer: 8 splits at head dim 256) compiled for sm_90: the
    trigger comes before the wait, so the o_proj after it copies its weights while the attention runs, and every
    read of the partials after the wait."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMBINE], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0 <= got["trigger"] < got["wait"] < got["first_load"], got


def test_the_skinny_matmul_on_its_plan_compiles_and_the_attention_launch_names_what_it_lacks(tmp_path):
    """--gemv N K: the kernel skinny_linear launches for the 31B's down_proj [5,376 x 21,504] at batch 1, on
    gemv_plan's 64-column tile cut in 4 runs (336 programs); its registers are ptxas's. Without --gemv the
    attention launch's shape arguments are required, each named."""
    r = run("--gemv", "5376", "21504", "--ir", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kernel"] == "_gemv_kernel" and out["config"] == [64, 128, 4, 4]
    assert out["runs"] == 4 and out["programs"] == 336 and 0 < out["registers"] <= 255
    assert ".entry _gemv_kernel" in (tmp_path / "gemv.ptx").read_text()
    r = run("--head-dim", "256", "--page", "16")
    assert r.returncode == 2 and "needs --q-heads, --kv-heads" in r.stderr


def test_the_gate_up_with_its_prologue_compiles_a_program_a_block():
    """--form norm-gelu: the E4B's packed gate/up [20,480 x 2,560] as add_norm_gelu_linear launches it, a program
    for each of its 320 column blocks; an unknown form refused by name."""
    r = run("--gemv", "20480", "2560", "--form", "norm-gelu")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["form"] == "norm-gelu" and got["programs"] == 320
    assert got["runs"] == 1 and got["config"] == [64, 128, 4, 3] and 0 < got["registers"] <= 255
    r = run("--gemv", "20480", "2560", "--form", "tanh")
    assert r.returncode == 2 and "invalid choice: 'tanh'" in r.stderr

