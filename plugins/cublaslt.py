"""cuBLASLt by a measured algorithm: a serving-batch matmul whose algorithm the heuristic picks slowly, run by the one
that measured fastest on this GPU.

Why: torch asks cuBLASLt's heuristic for one algorithm a shape. For the 31B's K > N weights at 64 rows (5,376 outputs
from 8,192-21,504 inputs: fewer output tiles than SMs) the H200 reads them at 83-89 % of its copy bandwidth where
the gate/up reads at 95-96 % (export/results/README.md, session 24). `python -m g4rt.bench.blas_algos` times the
heuristic's candidates and their split-K variants on the GPU and writes the fastest, where it beats torch's own
choice, into ALGOS_FILE under the GPU's name; `tuned_linear` runs a matmul by that algorithm. A GPU, rows or
shape the file does not name keeps torch's path. The choice is a pure function of (GPU name, rows, weight shape),
so an eager and a compiled engine in any process run the same algorithm and compute the same bits.

The binding is ctypes over the libcublasLt torch loads (cublasLt.h of CUDA 12/13: every struct and enum used here
is stable across them); its calls enqueue on torch's current stream, so they are captured into CUDA graphs.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import sys
from pathlib import Path

import torch

ALGOS_FILE = Path(__file__).resolve().parent / "cublaslt_algos.json"

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


@functools.cache
def lt() -> CublasLt:
    return CublasLt()


def read_algos(path: Path | None = None) -> dict:
    """ALGOS_FILE (or `path`): {GPU name: [{"rows", "n", "k", "algo": CONFIG's names to values, "workspace",
    "measured"}]}; empty where there is no file."""
    path = ALGOS_FILE if path is None else path
    return json.loads(path.read_text()) if path.exists() else {}


@functools.cache
def _table(device_name: str) -> dict[tuple[int, int, int], dict]:
    return {(e["rows"], e["n"], e["k"]): e for e in read_algos().get(device_name, [])}


@functools.cache
def _tuned(device_index: int, rows: int, n: int, k: int) -> tuple[Algo, torch.Tensor] | None:
    entry = _table(torch.cuda.get_device_name(device_index)).get((rows, n, k))
    if entry is None:
        return None
    algo = lt().build(entry["algo"])
    need = None if algo is None else lt().checked(rows, n, k, algo)
    if need is None:  # a cuBLASLt that does not know the algorithm: torch's path, as for an unnamed shape
        return None
    return algo, torch.empty(max(need, 1), dtype=torch.uint8, device=f"cuda:{device_index}")


def tuned_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x @ w.T by the algorithm ALGOS_FILE names for this GPU, x's rows and w's shape; None where it names none
    (or the operands are not contiguous bf16 on one CUDA device)."""
    if not (x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and x.is_contiguous() and w.is_contiguous()
            and x.device == w.device and x.dim() == 2 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0):
        return None
    tuned = _tuned(x.device.index, x.shape[0], *w.shape)
    if tuned is None:
        return None
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    lt().linear(x, w, out, *tuned)
    return out
