"""The skinny-matmul kernel's tiles, stages and splits swept on one weight shape at a time (a GPU bench):
`python -m g4rt.bench.gemv_sweep --shape N K --layers L [--shape N K ...] --out DIR`. `bench.engine
--matmuls` times each role of a model on the op's candidate tiles; this takes one shape over many more
(`plans`), through the same record (`bench.engine.gemv_record`: every plan checked against F.linear before
its timing, the median replay of a CUDA graph of L launches with PDL as in the step, one per weight, L
distinct random weights, more bytes than L2), with each plan's time a launch beside the time its bytes take at
the copy bandwidth measured in the same process."""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from g4rt.bench.common import ceilings, log_json
from g4rt.bench.engine import gemv_record

NAME = "gemv_sweep.jsonl"


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs=2, type=int, action="append", required=True, metavar=("N", "K"),
                   help="a weight [N, K] to sweep (repeat for more)")
    p.add_argument("--layers", type=int, default=24, help="distinct weights a graph launches over (default 24)")
    p.add_argument("--reps", type=int, default=20, help="graph replays a plan's median is taken over (default 20)")
    p.add_argument("--out", type=Path, required=True, help=f"results directory (appends {NAME})")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(False)
    log_json(a.out, {"stage": "setup", "gpu": torch.cuda.get_device_name(), **ceil}, NAME)
    for n, k in a.shape:
        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        mats = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
                for _ in range(a.layers)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        rec = gemv_record(x, mats, a.reps, plans(n, k))
        ideal = n * k * x.element_size() / (ceil["copy_GBps"] * 1e9) * 1e3
        for c in rec["configs"]:
            if c.get("ms") is not None:
                c.update(ms_a_launch=round(c["ms"] / a.layers, 5), of_copy_bw=round(ideal * a.layers / c["ms"], 3))
        log_json(a.out, {**rec, "stage": "gemv_sweep", "ideal_ms_a_launch": round(ideal, 5)}, NAME)
        del mats
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
