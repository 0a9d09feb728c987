"""cuBLASLt's algorithms for decode's matmuls, each timed (issue 12: the K > N projections at serving batches).

torch asks cuBLASLt's heuristic for one algorithm a shape and runs it. At 64 rows the 31B's o_proj and down_proj
(K > N: 5,376 outputs) read their weights at 83-89 % of the copy bandwidth on an H200 where the gate/up reads at
95-96 %. Whether another of cuBLASLt's own algorithms reads them faster is a question of measurement: this bench asks
the heuristic for up to --algos candidates a shape, adds split-K variants of each (a weight with fewer output tiles
than SMs is cut over K), checks every candidate's product against fp32 on fresh random inputs with a poisoned
output, and times it over every layer's weight of the role in one CUDA graph (so no weight is still in L2), beside
torch's F.linear through cuBLAS and through cuBLASLt.

    python -m g4rt.bench.blas_algos --config 31b --rows 64 --roles o_proj,down_proj --out /tmp/algos

Records (jsonl): one `baseline` a role and rows (torch's cuBLAS and cuBLASLt), one `candidate` a timed algorithm
(its configuration, relative error, ms, fraction of the copy bandwidth), one `best` a role and rows.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from g4rt.plugins import cublaslt
from g4rt.plugins.triton_gemv import cublaslt_takes

from .common import ceilings, log_json
from .engine import decode_roles, graph_ms

WIN = 0.02  # --write keeps a candidate that is at least this much faster than torch's path for the shape


def step_roles(model) -> dict[tuple[str, tuple], int]:
    """The matmuls a CUDA decode step runs, {(role, weight shape): layers}: the packed gate/up and q/k/v where
    the engines pack them, every other Linear as it is (the KV-shared layers' lone q_proj among them), and the
    lm_head."""
    roles, fused = decode_roles(model)
    out = {key: len(layers) for key, layers in fused.items()}
    for (role, shape), ws in roles.items():
        kind, group, *_ = [*role.split("."), ""]  # sliding|full, mlp|self_attn (the lm_head: neither)
        packed = sum(any(tuple(p.shape) == shape for p in parts) for (r, _), layers in fused.items()
                     if r.startswith(f"{kind}.{group}.") for parts in layers)
        if len(ws) > packed:
            out[(role, shape)] = len(ws) - packed
    return out


def sweep(lt: cublaslt.CublasLt, role: str, shape: tuple, layers: int, m: int, bw: float, a) -> list[dict]:
    n, k = shape
    mats = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ mats[0].float().T
    nbytes = sum(w.numel() * w.element_size() for w in mats)
    frac = lambda ms: round(nbytes / (ms * 1e-3) / bw, 4)  # noqa: E731
    base = {"role": role, "shape": list(shape), "rows": m, "layers": layers}
    torch_ms = {}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        torch_ms[lib] = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in mats], a.reps)
    torch.backends.cuda.preferred_blas_library("default")
    path = "cublaslt" if cublaslt_takes(m, n, k) else "cublas"  # the library blas_linear takes without a table
    records = [{"stage": "baseline", **base, "path": path, **{f"{k}_ms": round(v, 4) for k, v in torch_ms.items()},
                **{f"{k}_of_copy_bw": frac(v) for k, v in torch_ms.items()}}]
    ws = torch.empty(a.workspace, dtype=torch.uint8, device="cuda")
    seen, cands = set(), []
    # the heuristic's answers under several workspace bounds: it ranks by what fits, so a bound of a few MiB (as
    # torch's) can bring candidates the widest one does not list
    heur = [h for limit in sorted({0, 1 << 20, 4 << 20, a.workspace}) if limit <= a.workspace
            for h in lt.heuristic(m, n, k, a.algos, limit)]
    for rank, h in enumerate(heur):
        variants = [h.algo]
        if lt.cap(h.algo, cublaslt.CAP_SPLITK_SUPPORT):
            mask = lt.cap(h.algo, cublaslt.CAP_REDUCTION_SCHEME_MASK)
            variants += [lt.variant(h.algo, splitk=s, reduction=r if s > 1 else 0)
                         for s in a.splits for r in cublaslt.REDUCTIONS if r & mask]
        for algo in variants:
            need = None if algo is None else lt.checked(m, n, k, algo)
            if need is None or need > a.workspace:
                continue
            cfg = lt.config(algo)
            key = tuple(sorted(cfg.items()))
            if key not in seen:
                seen.add(key)
                cands.append((algo, need, rank, cfg))
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for _, need, rank, cfg in cands[:a.max_candidates]:
        out.fill_(float("nan"))  # an element the algorithm does not write fails the check
        rec = {"stage": "candidate", **base, "heuristic_rank": rank, "workspace": need, "algo": cfg}
        algo = lt.build(cfg)  # what the table's reader runs: the algorithm rebuilt from its configuration
        if algo is None:
            records.append({**rec, "error": "not rebuilt from its configuration"})
            continue
        try:
            lt.linear(x, mats[0], out, algo, ws)
            torch.cuda.synchronize()
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            rec["rel_err"] = round(err, 6)
            if err < 2e-2:
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in mats]
                ms = graph_ms(lambda: [lt.linear(x, w, o, algo, ws) for w, o in zip(mats, outs)], a.reps)
                rec.update(ms=round(ms, 4), of_copy_bw=frac(ms))
        except cublaslt.CublasLtError as e:
            rec["error"] = str(e)[:160]
        records.append(rec)
    timed = [r for r in records if r.get("ms") is not None]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        first = next((r for r in timed if r["heuristic_rank"] == 0 and r["algo"]["splitk"] <= 1), None)
        records.append({"stage": "best", **base, "candidates": len(cands), "timed": len(timed), "path": path,
                        "path_ms": round(torch_ms[path], 4), "best_ms": best["ms"],
                        "best_of_copy_bw": best["of_copy_bw"], "best_workspace": best["workspace"],
                        "best": best["algo"], "gain": round(1 - best["ms"] / torch_ms[path], 4),
                        "heuristic_first_ms": None if first is None else first["ms"],
                        **{f"torch_{k}_ms": round(v, 4) for k, v in torch_ms.items()}})
    return records


def write_table(path: Path, gpu: str, bests: list[dict]) -> list[dict]:
    """Merge into `path` (ALGOS_FILE's format) this GPU's entries: each shape and rows whose best candidate beat
    torch's path by at least WIN; a shape and rows measured again without such a win loses its old entry."""
    table = cublaslt.read_algos(path)
    measured = {(b["rows"], *b["shape"]) for b in bests}
    entries = [e for e in table.get(gpu, []) if (e["rows"], e["n"], e["k"]) not in measured]
    won = [{"rows": b["rows"], "n": b["shape"][0], "k": b["shape"][1], "algo": b["best"],
            "workspace": b["best_workspace"],
            "measured": {"ms": b["best_ms"], "torch_ms": b["path_ms"], "torch_path": b["path"], "role": b["role"],
                         "layers": b["layers"]}}
           for b in bests if b["gain"] >= WIN]
    table[gpu] = sorted(entries + won, key=lambda e: (e["rows"], e["n"], e["k"]))
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return won


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="31b", help="model config name or config.json path")
    ap.add_argument("--rows", default="64", help="comma-separated batch rows, e.g. 64,128,256")
    ap.add_argument("--roles", default="o_proj,down_proj",
                    help="roles whose name holds one of these comma-separated parts (empty: every role a step runs)")
    ap.add_argument("--algos", type=int, default=32, help="candidates asked of the heuristic a shape")
    ap.add_argument("--splits", default="1,2,3,4,6,8,12,16", help="split-K counts tried on algorithms that allow it")
    ap.add_argument("--max-candidates", type=int, default=200, help="most candidates timed a shape")
    ap.add_argument("--workspace", type=int, default=32 << 20, help="workspace bytes a candidate may use")
    ap.add_argument("--reps", type=int, default=10, help="graph replays a timing's median is taken over")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--write", type=Path, nargs="?", const=cublaslt.ALGOS_FILE, default=None,
                    help=f"merge the shapes whose best candidate beats torch's path by {WIN * 100:.0f} %% or more "
                         "into this table (default the package's plugins/cublaslt_algos.json), under this GPU's name")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: it times cuBLASLt's kernels")
    a.splits = [int(s) for s in a.splits.split(",") if s]
    from g4rt.models.config import load_config
    from g4rt.models.model import Gemma4Model
    model = Gemma4Model(load_config(a.config), dtype=torch.bfloat16, device="meta")  # shapes only
    parts = [p for p in a.roles.split(",") if p]
    roles = {k: v for k, v in step_roles(model).items() if not parts or any(p in k[0] for p in parts)}
    a.out.mkdir(parents=True, exist_ok=True)
    log = functools.partial(log_json, a.out, name="blas_algos.jsonl")
    ceil = ceilings(quick=False)
    log({"stage": "setup", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "config": a.config,
         "copy_GBps": ceil["copy_GBps"], "roles": [[r, list(s), n] for (r, s), n in roles.items()]})
    lt, bests = cublaslt.lt(), []
    for m in (int(r) for r in a.rows.split(",")):
        for (role, shape), layers in roles.items():
            for rec in sweep(lt, role, shape, layers, m, ceil["copy_GBps"] * 1e9, a):
                log(rec)
                if rec["stage"] == "best":
                    bests.append(rec)
                if rec["stage"] != "candidate":
                    print({k: v for k, v in rec.items() if k != "stage"}, flush=True)
            torch.cuda.empty_cache()  # the role's weights, before the next role's
    if a.write is not None:
        won = write_table(a.write, torch.cuda.get_device_name(), bests)
        log({"stage": "table", "path": str(a.write), "entries": [[e["rows"], e["n"], e["k"]] for e in won]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
