"""Why torch's cuBLAS call of one shape took 15.5-15.7 % longer in one process than in another (session 57, an
H100: the 31B's packed sliding q/k/v and full gate/up at 64 rows). Run in several fresh processes
(export/results/s58_blasvar.sh); each prints one JSON line a (role, library, allocation): the median of a CUDA graph
over every layer's weight of the role (as bench.blas_algos times it), and the kernels one F.linear launches (their
names, from the profiler). Each role's weights are allocated twice in the process (`alloc` 0 and 1,
fresh tensors the second time, the first freed): a time that moves with the allocation and not the kernel is the
memory's, one that moves with the kernel is the heuristic's. argv: ROWS (default 64), ROUNDS (allocations a role
and layout, default 2), LAYOUTS (comma-separated, default `separate`: a tensor a layer's weight, as a model holds
them; `one`: every layer's weight a view into one tensor, one allocation for the role), ROLES (default the two)."""
import json
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from g4rt.bench.blas_algos import step_roles
from g4rt.bench.engine import graph_ms
from g4rt.models.config import load_config
from g4rt.models.model import Gemma4Model

ROWS, ROUNDS, LAYOUTS, WANT = [*sys.argv[1:], "", "", "", ""][:4]
ROWS, ROUNDS = int(ROWS or 64), int(ROUNDS or 2)
LAYOUTS = (LAYOUTS or "separate").split(",")
WANT = tuple((WANT or "sliding.self_attn.qkv,full.mlp.gate_up").split(","))
model = Gemma4Model(load_config("31b"), dtype=torch.bfloat16, device="meta")
roles = {k: v for k, v in step_roles(model).items() if k[0] in WANT}
assert len(roles) == len(WANT), f"roles {sorted(r for r, _ in step_roles(model))} lack one of {WANT}"


def kernels(fn) -> list:
    with profile(activities=[ProfilerActivity.CUDA], record_shapes=False) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def weights(n: int, k: int, layers: int, layout: str) -> list[torch.Tensor]:
    if layout == "one":
        return list((torch.randn(layers, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).unbind(0))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(layers)]


for (role, (n, k)), layers in roles.items():
    for alloc, layout in ((r, lay) for r in range(ROUNDS) for lay in LAYOUTS):
        mats = weights(n, k, layers, layout)
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            ms = graph_ms(lambda: [F.linear(x, w) for w in mats], 20)
            print(json.dumps({"role": role, "shape": [n, k], "layers": layers, "rows": ROWS, "alloc": alloc,
                              "layout": layout,
                              "lib": lib, "ms": round(ms, 4), "GBps": round(layers * n * k * 2 / ms / 1e6, 1),
                              "w0_ptr_mod_2M": mats[0].data_ptr() % (2 << 20),
                              "kernels": kernels(lambda: F.linear(x, mats[0]))}), flush=True)
        torch.backends.cuda.preferred_blas_library("default")
        del mats, x
        torch.cuda.empty_cache()
