"""torch's own cuBLASLt call for the 31B's sliding o_proj and down_proj at 64 rows, run once each: under
CUBLASLT_LOG_LEVEL=5 (export/results/s53_algos.sh) cuBLASLt's log names the algorithm torch's heuristic query chose,
which bench.blas_algos' candidates did not include on an H100 (session 53)."""
import torch
import torch.nn.functional as F

torch.backends.cuda.preferred_blas_library("cublaslt")
for n, k in ((5376, 8192), (5376, 21504)):
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    F.linear(x, w)
    torch.cuda.synchronize()
