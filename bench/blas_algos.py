"""cuBLASLt's algorithms for decode's matmuls, each timed (issue 12: the K > N projections at serving batches).

torch asks cuBLASLt's heuristic for one algorithm a shape and runs it. At 64 rows the 31B's o_proj and down_proj
(K > N: 5,376 outputs) read their weights at 83-89 % of the copy bandwidth on an H200 where the gate/up reads at
95-96 %. Whether another of cuBLASLt's own algorithms reads them faster is a question of measurement: this bench asks
the heuristic for up to --algos candidates a shape, adds split-K variants of each (a weight with fewer output tiles
than SMs is cut over K), checks every candidate's product against fp32 on fresh random inputs with a poisoned
output, and times it over every layer's weight of the role in one CUDA graph (so no weight is still in L2), beside
torch's F.linear through cuBLAS and through cuBLASLt.

    python -m g4rt.bench.blas_algos --config 31b --rows 64 --roles o_proj,down_proj --out /tmp/algos

With --rounds and --layouts a role's weights are allocated afresh several times, each allocation with its own
baseline (`--max-candidates 0`: only those): a time that moves between allocations where the kernel does not is the
memory's, not the heuristic's.

Records (jsonl): one `baseline` a role, rows and allocation (torch's cuBLAS and cuBLASLt: times and kernels), one
`candidate` a timed algorithm (its configuration, relative error, ms, fraction of the copy bandwidth), one `best` a
role and rows (its `gain` over the path blas_linear takes for the shape). A candidate is timed as rebuilt from its
configuration (cublasLtMatmulAlgoInit and its attributes), so a record names an algorithm that can be run again.

The binding is ctypes over the libcublasLt torch loads (cublasLt.h of CUDA 12/13: every struct and enum used here
is stable across them); its calls enqueue on torch's current stream, so they are captured into CUDA graphs.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import os
import sys
from pathlib import Path

import torch

from g4rt.models.config import load_config
from g4rt.models.model import Gemma4Model
from g4rt.plugins.triton_gemv import cublaslt_takes

from .common import ceilings, log_json
from .engine import decode_roles, graph_ms

CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
# cublasLtMatmulAlgoConfigAttributes_t, in the order an algorithm is rebuilt: (name, id, ctype); the id is set by
# cublasLtMatmulAlgoInit
CONFIG = (("algo_id", 0, ctypes.c_int32), ("tile", 1, ctypes.c_uint32), ("splitk", 2, ctypes.c_int32),
          ("reduction", 3, ctypes.c_uint32), ("swizzle", 4, ctypes.c_uint32), ("custom", 5, ctypes.c_uint32),
          ("stages", 6, ctypes.c_uint32), ("inner_shape", 7, ctypes.c_uint16), ("cluster", 8, ctypes.c_uint16))
CAP_SPLITK_SUPPORT, CAP_REDUCTION_SCHEME_MASK = 0, 1  # cublasLtMatmulAlgoCapAttributes_t
REDUCTIONS = (1, 2, 4)  # cublasLtReductionScheme_t: in place, in the compute type's workspace, in the output's


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


def _library() -> ctypes.CDLL:
    """The libcublasLt torch runs (a first matmul loads it), else one from its nvidia wheels."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    names = ["libcublasLt.so.13", "libcublasLt.so.12"]
    for root in sys.path:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcublasLt.so*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CublasLtError("libcublasLt not found beside torch (tried " + ", ".join(names[:2]) + " and torch's wheels)")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what}: cublasStatus_t {status}")


def _size(n: int) -> ctypes.c_size_t:
    return ctypes.c_size_t(n)


class CublasLt:
    """One handle, and the descriptors of y [m, n] = x [m, k] @ w [n, k].T in bf16 with fp32 accumulation
    (cuBLAS's column-major view: D [n, m] = op_T(W) [n, k] @ X [k, m])."""

    def __init__(self):
        self.lib = _library()
        self.handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._descs = {}

    def descs(self, m: int, n: int, k: int) -> tuple:
        if (m, n, k) not in self._descs:
            lib, desc = self.lib, ctypes.c_void_p()
            _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
            for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
                v = ctypes.c_int32(op)
                _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), _size(4)), "desc attribute")
            layouts = []
            for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # W, X, Y, column-major
                lay = ctypes.c_void_p()
                _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, ctypes.c_uint64(rows),
                                                      ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
                layouts.append(lay)
            self._descs[m, n, k] = (desc, *layouts)
        return self._descs[m, n, k]

    def heuristic(self, m: int, n: int, k: int, count: int, workspace: int) -> list[HeuristicResult]:
        """Up to `count` of the heuristic's candidates, best first, that need at most `workspace` bytes."""
        desc, a, b, c = self.descs(m, n, k)
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            ws = ctypes.c_uint64(workspace)
            _check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                                 _size(8)), "preference attribute")
            results, got = (HeuristicResult * count)(), ctypes.c_int()
            _check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                           ctypes.byref(got)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(got.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict:
        """The algorithm's configuration, CONFIG's names to values (what `build` takes back)."""
        out = {}
        for name, attr, ctype in CONFIG:
            v, written = ctype(), ctypes.c_size_t()
            _check(self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                                 _size(ctypes.sizeof(v)), ctypes.byref(written)),
                   f"algo config {name}")
            out[name] = v.value
        return out

    def cap(self, algo: Algo, attr: int) -> int:
        v, written = ctypes.c_int32(), ctypes.c_size_t()
        _check(self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), _size(4),
                                                          ctypes.byref(written)), "algo capability")
        return v.value

    def _set(self, algo: Algo, config: dict) -> bool:
        for name, attr, ctype in CONFIG[1:]:
            v = ctype(config[name])
            if self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                             _size(ctypes.sizeof(v))):
                return False
        return True

    def checked(self, m: int, n: int, k: int, algo: Algo) -> int | None:
        """The workspace bytes `algo` needs for this shape, or None where cuBLASLt refuses it."""
        desc, a, b, c = self.descs(m, n, k)
        res = HeuristicResult()
        if self.lib.cublasLtMatmulAlgoCheck(self.handle, desc, a, b, c, c, ctypes.byref(algo), ctypes.byref(res)):
            return None
        return res.workspace_size

    def variant(self, algo: Algo, **changes) -> Algo | None:
        """A copy of `algo` with some of its configuration changed (e.g. splitk, reduction); None where refused."""
        new = Algo()
        ctypes.memmove(ctypes.byref(new), ctypes.byref(algo), ctypes.sizeof(Algo))
        return new if self._set(new, {**self.config(algo), **changes}) else None

    def build(self, config: dict) -> Algo | None:
        """The algorithm `config` names (cublasLtMatmulAlgoInit, then its attributes), None where this library
        refuses it."""
        algo = Algo()
        if self.lib.cublasLtMatmulAlgoInit(self.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF,
                                           CUDA_R_16BF, CUDA_R_16BF, int(config["algo_id"]), ctypes.byref(algo)):
            return None
        return algo if self._set(algo, config) else None

    def linear(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: Algo, ws: torch.Tensor) -> None:
        """out = x @ w.T by `algo` on torch's current stream (capturable); `ws` its workspace."""
        m, k = x.shape
        desc, a, b, c = self.descs(m, w.shape[0], k)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        _check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(one), ctypes.c_void_p(w.data_ptr()), a, ctypes.c_void_p(x.data_ptr()), b,
            ctypes.byref(zero), ctypes.c_void_p(out.data_ptr()), c, ctypes.c_void_p(out.data_ptr()), c,
            ctypes.byref(algo), ctypes.c_void_p(ws.data_ptr()), _size(ws.numel()),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cublasLtMatmul")


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


def config_key(config: dict) -> tuple:
    """An algorithm's configuration as a hashable key (two answers with the same key are one candidate)."""
    return tuple(sorted(config.items()))


def candidates(lt: CublasLt, m: int, n: int, k: int, a) -> tuple[list, dict]:
    """The candidates to time for an [m x k] @ [n x k]^T: ([(workspace, [bound, rank], configuration)], {bound: the
    configuration key of its first answer}). The heuristic is asked under several workspace bounds: it ranks by what
    fits, so a bound of a few MiB can bring candidates the widest one does not list (torch asks under 1 MiB). Each
    answer adds itself and its split-K variants that pass `checked` within --workspace bytes; an answer a smaller
    bound gave already is not asked for its variants again."""
    seen, answered, cands, firsts = set(), set(), [], {}
    for bound in sorted({b for b in (0, 1 << 20, 4 << 20) if b < a.workspace} | {a.workspace}):
        for rank, h in enumerate(lt.heuristic(m, n, k, a.algos, bound)):
            answer = config_key(lt.config(h.algo))
            if rank == 0:
                firsts[bound] = answer
            if answer in answered:
                continue
            answered.add(answer)
            variants = [h.algo]
            if lt.cap(h.algo, CAP_SPLITK_SUPPORT):
                mask = lt.cap(h.algo, CAP_REDUCTION_SCHEME_MASK)
                variants += [lt.variant(h.algo, splitk=s, reduction=r if s > 1 else 0)
                             for s in a.splits for r in REDUCTIONS if r & mask]
            for algo in variants:
                need = None if algo is None else lt.checked(m, n, k, algo)
                if need is None or need > a.workspace:
                    continue
                cfg = lt.config(algo)
                if (key := config_key(cfg)) not in seen:
                    seen.add(key)
                    cands.append((need, [bound, rank], cfg))
    return cands, firsts


def weights(n: int, k: int, layers: int, layout: str) -> list[torch.Tensor]:
    """Fresh random [n, k] weights, one a layer: `separate` a tensor each (as a model holds them), `one` views into
    one tensor (one allocation for the role)."""
    if layout == "one":
        return list((torch.randn(layers, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).unbind(0))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]


def kernel_names(fn) -> list[str]:
    """The CUDA kernels `fn` launches, by name (the profiler's), in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def of_copy_bw(mats: list, ms: float, bw: float) -> float:
    """The fraction of the copy bandwidth `bw` (bytes/s) at which a pass over `mats` in `ms` read them."""
    return round(sum(w.numel() * w.element_size() for w in mats) / (ms * 1e-3) / bw, 4)


def baseline(x: torch.Tensor, mats: list, base: dict, bw: float, reps: int) -> dict:
    """torch's F.linear over `mats` through cuBLAS and through cuBLASLt: each one's graph time, fraction of the copy
    bandwidth and kernels (which algorithm the library's heuristic took), and the library blas_linear takes."""
    (n, k), m = mats[0].shape, x.shape[0]
    rec = {"stage": "baseline", **base, "path": "cublaslt" if cublaslt_takes(m, n, k) else "cublas"}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        ms = graph_ms(lambda: [torch.nn.functional.linear(x, w) for w in mats], reps)
        rec.update({f"{lib}_ms": round(ms, 4), f"{lib}_of_copy_bw": of_copy_bw(mats, ms, bw),
                    f"{lib}_kernels": kernel_names(lambda: torch.nn.functional.linear(x, mats[0]))})
    torch.backends.cuda.preferred_blas_library("default")
    return rec


def sweep(lt: CublasLt, role: str, shape: tuple, layers: int, m: int, bw: float, a) -> list[dict]:
    """The role's baselines, one for each of --rounds fresh allocations of each of --layouts (a time that moves
    with the allocation and not the kernel is the memory's), then its candidates timed over the first one."""
    n, k = shape
    base = {"role": role, "shape": list(shape), "rows": m, "layers": layers}
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    mats = weights(n, k, layers, a.layouts[0])  # the candidates' weights
    records = [baseline(x, mats, {**base, "round": 0, "layout": a.layouts[0]}, bw, a.reps)]
    for rnd, layout in [(r, lay) for r in range(a.rounds) for lay in a.layouts][1:]:
        records.append(baseline(x, weights(n, k, layers, layout), {**base, "round": rnd, "layout": layout}, bw,
                                a.reps))
        torch.cuda.empty_cache()  # that allocation's weights, before the next one's
    path, torch_ms = records[0]["path"], {lib: records[0][f"{lib}_ms"] for lib in ("cublas", "cublaslt")}
    want = x.float() @ mats[0].float().T
    ws = torch.empty(a.workspace, dtype=torch.uint8, device="cuda")
    cands, firsts = candidates(lt, m, n, k, a)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    for need, answer, cfg in cands[:a.max_candidates]:
        out.fill_(float("nan"))  # an element the algorithm does not write fails the check
        rec = {"stage": "candidate", **base, "heuristic": answer, "workspace": need, "algo": cfg}
        algo = lt.build(cfg)  # timed as rebuilt from its configuration, so the record can be run again
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
                rec.update(ms=round(ms, 4), of_copy_bw=of_copy_bw(mats, ms, bw))
        except CublasLtError as e:
            rec["error"] = str(e)[:160]
        records.append(rec)
    timed = [r for r in records if r.get("ms") is not None]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        ms_of = {config_key(r["algo"]): r["ms"] for r in timed}
        records.append({"stage": "best", **base, "candidates": len(cands), "timed": len(timed), "path": path,
                        "path_ms": torch_ms[path], "best_ms": best["ms"],
                        "best_of_copy_bw": best["of_copy_bw"], "best_workspace": best["workspace"],
                        "best": best["algo"], "gain": round(1 - best["ms"] / torch_ms[path], 4),
                        "heuristic_first_ms": {bound: ms_of.get(key) for bound, key in firsts.items()},
                        **{f"torch_{k}_ms": v for k, v in torch_ms.items()}})
    return records


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
    ap.add_argument("--rounds", type=int, default=1,
                    help="fresh allocations of a role's weights, each with its own baseline "
                         "(with --max-candidates 0: only those)")
    ap.add_argument("--layouts", default="separate",
                    help="comma-separated: separate (a tensor a layer's weight) and/or one (views into one tensor)")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    a = ap.parse_args(argv)
    a.splits = [int(s) for s in a.splits.split(",") if s]
    a.layouts = [lay for lay in a.layouts.split(",") if lay]
    if a.rounds < 1 or not a.layouts or set(a.layouts) - {"separate", "one"}:
        ap.error(f"--rounds {a.rounds} --layouts {','.join(a.layouts)}: at least one round of separate and/or one")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: it times cuBLASLt's kernels")
    model = Gemma4Model(load_config(a.config), dtype=torch.bfloat16, device="meta")  # shapes only
    parts = [p for p in a.roles.split(",") if p]
    roles = {k: v for k, v in step_roles(model).items() if not parts or any(p in k[0] for p in parts)}
    a.out.mkdir(parents=True, exist_ok=True)
    log = functools.partial(log_json, a.out, name="blas_algos.jsonl")
    ceil = ceilings(quick=False)
    log({"stage": "setup", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "config": a.config,
         "copy_GBps": ceil["copy_GBps"], "roles": [[r, list(s), n] for (r, s), n in roles.items()]})
    lt = CublasLt()
    for m in (int(r) for r in a.rows.split(",")):
        for (role, shape), layers in roles.items():
            for rec in sweep(lt, role, shape, layers, m, ceil["copy_GBps"] * 1e9, a):
                log(rec)
                if rec["stage"] != "candidate":
                    print({k: v for k, v in rec.items() if k != "stage"}, flush=True)
            torch.cuda.empty_cache()  # the role's weights, before the next role's
    return 0


if __name__ == "__main__":
    sys.exit(main())
