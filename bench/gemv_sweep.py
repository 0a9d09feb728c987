"""The skinny-matmul kernel's tiles, stages and splits swept on one weight shape at a time (a GPU bench):
`python -m g4rt.bench.gemv_sweep --shape N K --layers L [--shape N K ...] --out DIR`. `bench.engine
--matmuls` times each role of a model on the op's candidate tiles; this takes one shape over many more
(`plans`), through the same record (`bench.engine.gemv_record`: every plan checked against F.linear before
its timing, the median replay of a CUDA graph of L launches with PDL as in the step, one per weight, L
distinct random weights, more bytes than L2), with each plan's time a launch beside the time its bytes take at
the copy bandwidth measured in the same process. `--forms` also times the op's own plan in the forms the step
runs a packed gate/up in (FORMS), to tell what its epilogue and its prologue cost a launch; `--op-only` times
the op's plan alone."""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from g4rt.bench.common import ceilings, log_json
from g4rt.bench.engine import graph_ms, gemv_record
from g4rt.models import blocks
from g4rt.plugins import triton_gemv as tg

NAME = "gemv_sweep.jsonl"
# The forms of one launch `--forms` times: `gelu`, the gated GELU of the weight's two halves (gate rows, then up
# rows) in the epilogue, as gelu_linear runs a packed gate/up; `norm-gelu`, its input formed in the prologue too,
# from a residual step and the norm after it (ResidualNorm with out_weight), as add_norm_gelu_linear runs the MLP
# after the attention's residual step.
FORMS = ("gelu", "norm-gelu")
EPS = 1e-6


def plans(n: int, k: int) -> list[tuple[tuple[int, int, int, int], int]]:
    """(tile, splits) for a weight [n, k]: 100-800 programs, at most 160 KB of weight tiles in flight, 8 warps
    for tiles of 32K elements and more, and a split only where every run has two tiles or more."""
    out = []
    for (bn, bk), warps, stages, splits in itertools.product(
            ((16, 512), (16, 1024), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128), (128, 64)),
            (4, 8), (3, 4, 6, 8), (1, 2, 4, 8)):
        tiles = -(-k // bk)
        programs = -(-n // bn) * min(splits, tiles)
        if ((warps == 8) == (bn * bk >= 32768) and bn * bk * 2 * stages <= 160 << 10 and 100 <= programs <= 800
                and (splits == 1 or tiles >= 2 * splits)):
            out.append(((bn, bk, warps, stages), splits))
    return out


def form_record(form: str, x: torch.Tensor, mats: list[torch.Tensor], reps: int) -> dict:
    """The op's plan for `mats`' shape in `form` (FORMS), its values against the torch blocks in fp64 on the first
    weight (relative to their largest, before any timing; no time where it is off by more than 16 ulps), then the
    median replay of a graph of a launch a weight."""
    n, k = mats[0].shape
    config, splits = tg.gemv_plan(n, k, x.device, packed_gelu=True)
    norm, w64 = None, mats[0].double()
    if form == "norm-gelu":
        g = torch.Generator(device=x.device).manual_seed(k)
        res, w1, w2 = (torch.randn(t, device=x.device, generator=g).to(x.dtype) for t in (x.shape, k, k))
        norm = tg.ResidualNorm(res, w1, w2, EPS, torch.empty_like(res))
        want = blocks.add_norm_gelu_linear(res.double(), x.double(), w1.double(), w2.double(), EPS, w64, None)[1]
    else:
        want = blocks.gelu_linear(x.double(), w64, None)

    def launch(w):
        return tg.gemv(x, w, config, splits=splits, halves=True, norm=norm)

    err = ((launch(mats[0]).double() - want).abs().max() / want.abs().max()).item()
    # 16 ulps of the largest output: the bound tests/test_plugins_gemv.py holds the prologue's chain of roundings to
    ms = graph_ms(lambda: [launch(w) for w in mats], reps) if err < 16 * torch.finfo(x.dtype).eps else None
    return {"stage": "gemv_form", "form": form, "shape": [n, k], "layers": len(mats), "config": [*config, splits],
            "rel_err": round(err, 5), "ms": None if ms is None else round(ms, 4),
            "ms_a_launch": None if ms is None else round(ms / len(mats), 5)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs=2, type=int, action="append", required=True, metavar=("N", "K"),
                   help="a weight [N, K] to sweep (repeat for more)")
    p.add_argument("--layers", type=int, default=24, help="distinct weights a graph launches over (default 24)")
    p.add_argument("--reps", type=int, default=20, help="graph replays a plan's median is taken over (default 20)")
    p.add_argument("--out", type=Path, required=True, help=f"results directory (appends {NAME})")
    p.add_argument("--forms", default="", help=f"also the op's plan in these forms, comma-separated, of {FORMS} "
                                               "(the shape a packed gate/up: N even)")
    p.add_argument("--op-only", action="store_true", help="sweep the op's own plan only (no other tiles)")
    a = p.parse_args(argv)
    forms = [f for f in a.forms.split(",") if f]
    if bad := [f for f in forms if f not in FORMS]:
        p.error(f"--forms: unknown {bad}, expected some of {FORMS}")
    a.out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(False)
    log_json(a.out, {"stage": "setup", "gpu": torch.cuda.get_device_name(), **ceil}, NAME)
    for n, k in a.shape:
        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        mats = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
                for _ in range(a.layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        rec = gemv_record(x, mats, a.reps, [] if a.op_only else plans(n, k))
        ideal = n * k * x.element_size() / (ceil["copy_GBps"] * 1e9) * 1e3
        for c in rec["configs"]:
            if c.get("ms") is not None:
                c.update(ms_a_launch=round(c["ms"] / a.layers, 5), of_copy_bw=round(ideal * a.layers / c["ms"], 3))
        log_json(a.out, {**rec, "stage": "gemv_sweep", "ideal_ms_a_launch": round(ideal, 5)}, NAME)
        for form in forms:
            log_json(a.out, {**form_record(form, x, mats, a.reps), "ideal_ms_a_launch": round(ideal, 5)}, NAME)
        del mats
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
