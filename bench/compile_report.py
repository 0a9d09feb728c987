"""The paged attention kernel (plugins/triton_attention.py, or at head dim 512 prefill on Hopper the Gluon one,
plugins/gluon_attention.py), or with `--gemv N K` the skinny matmul's (plugins/triton_gemv.py) on the plan
`gemv_plan` gives a weight [N, K], compiled for a GPU target on any machine, no GPU needed, and what ptxas says of
it: registers a thread uses, bytes spilled, shared memory a block asks for, and the machine instructions in each
of its loops (`loop_instructions`, by `cuobjdump -sass`: a key tile's or a K step's work); `--ir DIR` also writes
its TTGIR (where the loop's copies and matmuls sit, their layouts), PTX and SASS.

    python -m g4rt.bench.compile_report --head-dim 512 --page 160 --q-heads 32 --kv-heads 4 \\
        [--decode [--splits 1] [--programs-per-sm 0] [--write] [--norm]] [--window] [--dtype bfloat16]
        [--kv-dtype float8_e4m3fn] [--config '{"num_stages": 3}']
        [--arch 90] [--ir DIR]
    python -m g4rt.bench.compile_report --gemv 5376 21504 [--rows 1] [--form plain]
        [--dtype bfloat16] [--arch 90] [--ir DIR]
    python -m g4rt.bench.compile_report --sampler [--chunks 64] [--arch 90] [--ir DIR]

The launch is `paged_attention`'s: its default_config with `--config` over it, the kernel it picks for that
shape (`takes_wgmma`; `--config '{"wgmma": false}'` keeps the Triton kernel), its constexprs, the 16-byte
divisibility the JIT infers for the pointers and the arena's offsets, the copy descriptors where they are
taken. The report is the installed Triton's: run it with the version the GPU runs (the H200's image: triton
3.6) to read that machine's kernel.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from triton.experimental.gluon._runtime import GluonASTSource

from g4rt.models.layout import torch_dtype
from g4rt.plugins import gluon_attention as ga
from g4rt.plugins import launch
from g4rt.plugins import triton_attention as ta
from g4rt.plugins import triton_gemv as tg
from g4rt.plugins.trt_kernels import ELEM_BYTES, TRITON_DTYPES

KV_TRITON_DTYPES = {**TRITON_DTYPES, "float8_e4m3fn": "fp8e4nv"}  # an arena's dtypes, by layout.KV_DTYPES' names

ALIGNED_INTS = ("k_offset", "v_offset", "stride_frame")  # multiples of 16 in every arena the runtime builds


def attention_report(*, head_dim: int, page: int, q_heads: int, kv_heads: int, decode: bool = False,
                     splits: int = 1, programs_per_sm: float = 0.0, window: bool = False, dtype: str = "bfloat16",
                     config: dict | None = None, arch: int = 90, write: bool = False, norm: bool = False,
                     kv_dtype: str | None = None) -> dict:
    """Compile the kernel `paged_attention` would launch on a GPU of compute capability `arch`: the Gluon one
    where `takes_wgmma` holds (compute capability 9.x), else `_paged_attn_kernel`; returns which, the tiles, whether
    the copy descriptors were taken, registers, spill bytes (stores), shared bytes, the TTGIR and the PTX.
    `write`: a decode launch that writes the step's K/V rows itself (`paged_attention(write=...)`); `norm`: one
    that norms and ropes its q, and with `write` those rows, from the layer's packed projection (`norms=`).
    `kv_dtype`: the arena's (default `dtype`; float8_e4m3fn the one-byte arena)."""
    if (write or norm) and not decode:
        raise ValueError("write, norm: only a decode launch writes the step's K/V rows or norms its q itself")
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TRITON_DTYPES)}, got {dtype!r}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    kv_dtype = kv_dtype or dtype
    if kv_dtype not in KV_TRITON_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_TRITON_DTYPES)}, got {kv_dtype!r}")
    kv_bytes = torch_dtype(kv_dtype, kv=True).itemsize
    cfg = {**ta.default_config(head_dim, decode, ELEM_BYTES[dtype], splits, programs_per_sm, kv_bytes,
                               q_heads // kv_heads), **(config or {})}
    window_left = 0 if window else -1
    t = TRITON_DTYPES[dtype]
    if (arch // 10 == 9 and kv_dtype == dtype
            and ta.takes_wgmma(cfg, decode, window_left, head_dim, ELEM_BYTES[dtype], q_heads // kv_heads, page)):
        fn, const, tma = ga._paged_attn_wgmma_kernel, ga.launch_constexprs(q_heads, kv_heads, head_dim, page), True
        desc = f"tensordesc<{t}[1, {ga.BLOCK_N}, {head_dim}],{ga.kv_layout(head_dim)!r}>"
        sig = {name: "i32" for name in fn.arg_names} | {"k_desc": desc, "v_desc": desc}
        source, options = GluonASTSource, {"num_warps": ga.NUM_WARPS.value}
    else:
        dv_split = cfg.get("dv_split", 1)
        tma = ta.takes_copies(cfg, decode, window_left, page)
        fn = ta._paged_attn_kernel
        sig = {name: "i32" for name in fn.arg_names} | {"ws_acc_ptr": "*fp32", "ws_ml_ptr": "*fp32"}
        const = ta.launch_constexprs(cfg, num_q_heads=q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                     page_size=page, num_splits=splits, fp32=dtype == "float32", copies=tma,
                                     decode=decode, kv_bytes=kv_bytes)
        const.update(PDL=arch >= 90, WRITE=write, NORM=norm)
        rows = {"k_new_ptr": f"*{t}" if write and not norm else None, "v_new_ptr": f"*{t}" if write and not norm
                else None, "slots_ptr": "*i32" if write else None, "qw_ptr": f"*{t}" if norm else None,
                "kw_ptr": f"*{t}" if norm and write else None, "cos_ptr": f"*{t}" if norm else None,
                "sin_ptr": f"*{t}" if norm else None, "eps": "fp32" if norm else None}
        sig.update({name: kind for name, kind in rows.items() if kind})
        const.update({name: None for name, kind in rows.items() if not kind})
        if tma:
            kv = KV_TRITON_DTYPES[kv_dtype]
            sig["k_desc"] = f"tensordesc<{kv}[1, {cfg['block_n']}, {head_dim}]>"
            sig["v_desc"] = f"tensordesc<{kv}[1, {cfg['block_n']}, {head_dim // dv_split}]>"
        else:
            const.update(k_desc=None, v_desc=None)
        source = triton.compiler.ASTSource
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "maxnreg": cfg.get("maxnreg")}
    sig.update({name: f"*{t}" for name in ("q_ptr", "out_ptr")}, arena_ptr=f"*{KV_TRITON_DTYPES[kv_dtype]}",
               scale="fp32",
               **{name: "*i32" for name in ("cu_q_ptr", "kv_lens_ptr", "table_ptr", "first_ptr")})
    sig.update({name: "constexpr" for name in const})
    aligned = [n for n in fn.arg_names if sig[n].startswith("*")] + list(ALIGNED_INTS)
    return {"kernel": fn.__name__, "config": cfg, "tma": tma,
            **compile_for(fn, sig, const, aligned, source, options, arch)}


# gemv_report's forms: the kernel as skinny_linear launches it, as gelu_linear launches a packed gate/up (its gated
# GELU in the epilogue), and as add_norm_gelu_linear launches one after the attention's residual step (its norms in
# the prologue too)
GEMV_FORMS = {"plain": (0, 0), "gelu": (1, 0), "norm-gelu": (1, 2)}


def gemv_report(*, n: int, k: int, rows: int = 1, form: str = "plain", dtype: str = "bfloat16",
                arch: int = 90) -> dict:
    """Compile `_gemv_kernel` as the ops launch it for `rows` rows against a weight [n, k] in `form` (GEMV_FORMS):
    gemv_plan's tile and runs over K for an H200's SMs; returns the tile, runs, programs (column blocks x runs),
    with what compile_for returns."""
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TRITON_DTYPES)}, got {dtype!r}")
    if not 1 <= rows <= tg.MAX_ROWS:
        raise ValueError(f"rows must be 1-{tg.MAX_ROWS}, got {rows}")
    if form not in GEMV_FORMS:
        raise ValueError(f"form must be one of {', '.join(GEMV_FORMS)}, got {form!r}")
    gelu, norm = GEMV_FORMS[form]
    config, runs = tg.gemv_plan(n, k, torch.device("cpu"), packed_gelu=gelu == 1)
    const, split_k = tg.launch_constexprs(rows, n, k, config, runs, dtype == "float32", gelu=gelu, norm=norm)
    const["PDL"] = arch >= 90
    fn, t = tg._gemv_kernel, TRITON_DTYPES[dtype]
    sig = {name: "i32" for name in fn.arg_names} | {name: f"*{t}" for name in fn.arg_names if name.endswith("_ptr")}
    sig.update(part_ptr="*fp32", lock_ptr="*i32", eps="fp32", **{name: "constexpr" for name in const})
    # the integers the JIT marks 16-divisible in gemv's launch (x, w contiguous; out [rows, n or n/2]; no up)
    ints = dict(M=rows, N=n, K=k, split_k=split_k, stride_x=k, stride_w=k, stride_out=n // 2 if gelu == 1 else n,
                stride_up=0)
    aligned = [name for name in fn.arg_names if name.endswith("_ptr")] + [name for name, v in ints.items() if v % 16 == 0]
    report = compile_for(fn, sig, const, aligned, triton.compiler.ASTSource,
                         {"num_warps": config[2], "num_stages": config[3]}, arch)
    return {"kernel": fn.__name__, "form": form, "config": list(config), "runs": const["SPLITS"],
            "programs": triton.cdiv(n, config[0]) * const["SPLITS"], **report}


def sampler_report(*, chunks: int = 64, arch: int = 90) -> list[dict]:
    """The token sampler's kernels (plugins/triton_sampling.py) as `sample()` launches them over fp32 logits on its
    default tile: the split kernels at `chunks` chunks a row (`first_pass_splits`: 64 for one row, 5 for 64 rows on an
    H100's 132 SMs), the row's kernel after them and alone (one program a row, no split); each with its
    constexprs and what compile_for returns."""
    from g4rt.plugins import triton_sampling as ts

    defaults = inspect.signature(ts.sample).parameters
    block, num_warps = defaults["block"].default, defaults["num_warps"].default
    tile, sp = dict(BLOCK=block), triton.next_power_of_2(chunks)
    rounds, groups = ts.SPLIT_ROUNDS, ts.pivot_groups(chunks, block)
    room = dict(C=ts.CANDIDATES, L=ts.LISTED)
    cases = ([(ts._first_pass_kernel, dict(G=groups, **tile)),
              (ts._gather_kernel, dict(G=groups, SP=sp, L=ts.LISTED, **tile))]
             + [(ts._round_kernel, dict(ROUND=q, SP=sp, **tile)) for q in range(rounds)]
             + [(ts._sample_kernel, dict(STAGED=True, GATHER=True, ROUNDS=rounds, SP=sp, **room, **tile)),
                (ts._sample_kernel, dict(STAGED=False, GATHER=False, ROUNDS=0, SP=1, **room, **tile))])
    pointers = {"x_ptr": "*fp32", "rows_ptr": "*i64", "part_ptr": "*fp32", "wins_ptr": "*i32", "mass_ptr": "*i64",
                "lanes_ptr": "*fp32", "count_ptr": "*i32", "cand_ptr": "*i32", "out_ptr": "*i64"}
    reports = []
    for fn, const in cases:
        sig = {n: pointers.get(n, "i32") for n in fn.arg_names} | {n: "constexpr" for n in const}
        aligned = [n for n in fn.arg_names if n.endswith("_ptr")]
        options = {"num_warps": num_warps, "enable_fp_fusion": False}  # as sample() launches them
        reports.append({"kernel": fn.__name__, "constexprs": const,
                        **compile_for(fn, sig, const, aligned, triton.compiler.ASTSource, options, arch)})
    return reports


def loop_instructions(sass: str) -> list[int]:
    """The instructions of each loop body in a `cuobjdump -sass` listing, in address order: a backward branch's
    span, from its target to the branch."""
    addr, loops = {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if not m:
            continue
        at = int(m.group(1), 16)
        addr[at] = len(addr)
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", m.group(2))
        if branch and (target := int(branch.group(1), 16)) < at and target in addr:
            loops.append(addr[at] - addr[target] + 1)
    return loops


def compile_for(fn, sig: dict, const: dict, aligned: list, source, options: dict, arch: int) -> dict:
    """Compile `fn` for compute capability `arch` with the `aligned` arguments 16-byte divisible, and ask ptxas
    of its PTX: registers, spill bytes (stores), shared bytes, each loop's instructions, the TTGIR, PTX and SASS."""
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(source(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cubin = os.path.join(tmp, "kernel.cubin")
        run = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", path, "-o", cubin],
                             capture_output=True, text=True, check=True)
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spill = re.search(r"(\d+) bytes spill stores", run.stderr)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else 0,
            "shared": compiled.metadata.shared, "loop_instructions": loop_instructions(sass),
            "ttgir": compiled.asm["ttgir"], "ptx": ptx, "sass": sass}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m g4rt.bench.compile_report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, help="the layer's head dim (256 sliding, 512 full)")
    ap.add_argument("--page", type=int, help="tokens per page of the layer's group")
    ap.add_argument("--q-heads", type=int, help="query heads (the 31B: 32)")
    ap.add_argument("--kv-heads", type=int, help="KV heads of the layer (the 31B: 16 sliding, 4 full)")
    ap.add_argument("--gemv", type=int, nargs=2, metavar=("N", "K"),
                    help="the skinny matmul's launch for a weight [N, K] instead (gemv_plan's tile and runs)")
    ap.add_argument("--rows", type=int, default=1, help="with --gemv: rows of x (1-128)")
    ap.add_argument("--form", default="plain", choices=sorted(GEMV_FORMS),
                    help="with --gemv: the launch's form (gelu: the packed gate/up's GELU in the epilogue; "
                         "norm-gelu: the residual step's norms in the prologue too)")
    ap.add_argument("--sampler", action="store_true",
                    help="the token sampler's kernels instead (sampler_report), a JSON line each")
    ap.add_argument("--chunks", type=int, default=64,
                    help="with --sampler: the chunks a row its split kernels cut (64: one row; 5: 64 rows on an H100)")
    ap.add_argument("--decode", action="store_true", help="the decode launch (one query per sequence)")
    ap.add_argument("--splits", type=int, default=1, help="decode's runs over the keys (the split epilogue if > 1)")
    ap.add_argument("--programs-per-sm", type=float, default=0.0,
                    help="an unsplit decode's programs an SM (sequences x KV heads / SMs): from WIDE_DECODE its "
                         "head-dim-256 tile is the one-warp one (the 31B's sliding layers from batch 64: 7.8)")
    ap.add_argument("--write", action="store_true",
                    help="a decode that writes the step's K/V rows itself (a cache-owning layer's decode launch)")
    ap.add_argument("--norm", action="store_true",
                    help="a decode that norms and ropes its q (with --write, its K/V rows too) from the projection")
    ap.add_argument("--window", action="store_true", help="a sliding layer: no copy descriptors")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TRITON_DTYPES))
    ap.add_argument("--kv-dtype", default=None, choices=sorted(KV_TRITON_DTYPES),
                    help="the arena's dtype (default --dtype; float8_e4m3fn: the one-byte arena)")
    ap.add_argument("--config", default="{}", help="JSON tile overrides over default_config, e.g. "
                                                   "'{\"rows\": 64, \"num_stages\": 3, \"tma\": false}'")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, 90 for Hopper")
    ap.add_argument("--ir", help="a folder for attention.ttgir, .ptx and .sass (gemv.* with --gemv, "
                                 "samplerI_KERNEL.* with --sampler)")
    args = ap.parse_args(argv)
    if launch.interpreting():
        ap.error("TRITON_INTERPRET is set: the interpreter compiles nothing; unset it to compile for a GPU")
    if args.sampler:
        if args.chunks < 2:
            ap.error(f"--chunks must be at least 2 (the split kernels' chunks a row), got {args.chunks}")
        for i, report in enumerate(sampler_report(chunks=args.chunks, arch=args.arch)):
            emit(report, args, f"sampler{i}_{report['kernel']}")
        return 0
    if args.gemv:
        try:
            report = gemv_report(n=args.gemv[0], k=args.gemv[1], rows=args.rows, form=args.form, dtype=args.dtype,
                                 arch=args.arch)
        except ValueError as e:
            ap.error(str(e))
        return emit(report, args, "gemv")
    missing = [f"--{name.replace('_', '-')}" for name in ("head_dim", "page", "q_heads", "kv_heads")
               if getattr(args, name) is None]
    if missing:
        ap.error(f"the attention launch needs {', '.join(missing)} (or --gemv N K for the skinny matmul)")
    if (args.write or args.norm) and not args.decode:
        ap.error("--write, --norm: only a decode launch writes the step's K/V rows or norms its q (add --decode)")
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as e:
        ap.error(f"--config is not JSON: {e}")
    report = attention_report(head_dim=args.head_dim, page=args.page, q_heads=args.q_heads,
                              kv_heads=args.kv_heads, decode=args.decode, splits=args.splits,
                              programs_per_sm=args.programs_per_sm, window=args.window,
                              dtype=args.dtype, config=config, arch=args.arch, write=args.write, norm=args.norm,
                              kv_dtype=args.kv_dtype)
    return emit(report, args, "attention")


def emit(report: dict, args, name: str) -> int:
    """Print the report less its IR as one JSON line; with --ir, write NAME.ttgir, NAME.ptx and NAME.sass there."""
    if args.ir:
        os.makedirs(args.ir, exist_ok=True)
        for ext in ("ttgir", "ptx", "sass"):
            with open(os.path.join(args.ir, f"{name}.{ext}"), "w") as f:
                f.write(report[ext])
    print(json.dumps({k: v for k, v in report.items() if k not in ("ttgir", "ptx", "sass")}
                     | {"triton": triton.__version__, "arch": f"sm_{args.arch}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
