"""Session 22's sweep of the skinny-matmul kernel's tiles, stages and splits on one shape at a time (H200):
`python export/results/s22_gemv_sweep.py --shape N K --layers L [--shape ...] --out FILE`. Every plan's result
against F.linear on fresh random weights (NaN-poisoned output) before its timing; the time is the median replay of
a CUDA graph of L launches, one per weight (L distinct weights, more bytes than L2), per layer, beside the copy
bandwidth measured in the same process."""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from g4rt.bench.common import ceilings
from g4rt.bench.engine import _graph_ms
from g4rt.plugins import triton_gemv as tg


def plans(n: int, k: int):
    for (bn, bk), warps, stages, splits in itertools.product(
            ((16, 512), (16, 1024), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128), (128, 64)),
            (4, 8), (3, 4, 6, 8), (1, 2, 4, 8)):
        programs = -(-n // bn) * min(splits, -(-k // bk))
        if (warps == 8) != (bn * bk >= 32768) or bn * bk * 2 * stages > 160 << 10 or not 100 <= programs <= 800:
            continue
        if splits > 1 and -(-k // bk) < 2 * splits:
            continue
        yield (bn, bk, warps, stages), splits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", nargs=2, type=int, action="append", required=True, metavar=("N", "K"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    ceil = ceilings(False)
    bw = ceil["copy_GBps"] * 1e9
    with open(a.out, "a") as f:
        f.write(json.dumps({"stage": "setup", "gpu": torch.cuda.get_device_name(), **ceil}) + "\n")
        for n, k in a.shape:
            g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
            mats = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
                    for _ in range(a.layers)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
            want = F.linear(x, mats[0]).float()
            ideal = n * k * 2 / bw * 1e3
            for cfg, splits in plans(n, k):
                rec = {"stage": "gemv_sweep", "shape": [n, k], "config": [*cfg, splits], "ideal_ms": round(ideal, 5)}
                try:
                    out = torch.full_like(want, float("nan"), dtype=x.dtype)
                    tg.gemv(x, mats[0], cfg, out=out, splits=splits)
                    rec["rel_err"] = round(((out.float() - want).abs().max() / want.abs().max()).item(), 5)
                    ms = _graph_ms(lambda: [tg.gemv(x, w, cfg, splits=splits) for w in mats], a.reps) / a.layers
                    rec.update(ms=round(ms, 5), of_copy_bw=round(ideal / ms, 3))
                except Exception as e:  # noqa: BLE001  (out of registers or shared memory)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                f.write(json.dumps(rec) + "\n")
                f.flush()
            best = sorted((json.loads(l) for l in open(a.out)), key=lambda r: r.get("ms", 1e9))
            best = [r for r in best if r.get("shape") == [n, k]][:5]
            print(json.dumps({"shape": [n, k], "plan": [*tg.gemv_plan(n, k, x.device)[0], tg.gemv_plan(n, k, x.device)[1]],
                              "best": [(r["config"], r["ms"], r["of_copy_bw"]) for r in best]}))
            del mats


if __name__ == "__main__":
    main()
