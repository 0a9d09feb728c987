#!/usr/bin/env bash
# H200 calls of session 13. One PART per call:
#
#   gemv   every matmul of a batch-1 decode through `g4rt::skinny_linear` (the Triton skinny matmul at up to
#          8 rows, narrower column blocks for narrow weights, and each launch asking the L2 for the first
#          bytes of its weight rows before it waits for the kernel before it). First the kernel against an
#          fp32 product on the E2B's and the 31B's shapes (outputs poisoned with NaN), then the E2B at
#          batch 1 (tokens against eager, tok/s, decode profile) for three arms alternated, a fresh process
#          each: base (ab/base: 1d0d673), a0 (ab/a0: new with PREFETCH_BYTES = 0) and new; then the 31B at
#          batch 1, new only. New is 1d0d673 with h200_s13_gemv_new.patch applied (the prefetch, measured
#          slower and not kept; the check's prefetch_bytes exists only there).
#   ab31   the 31B at batch 1 for three arms alternated twice: base, a0 (ab/a0: every matmul of at most 8
#          rows through the skinny matmul, no prefetch) and a1 (ab/a1: a0 where a weight gives every SM a
#          64-column block or is at most 64 MB, cuBLAS for the 31B's o_proj and down_proj: this code with
#          NARROW_BYTES = 64 << 20); then the E4B, base against a0, once each.
#   final  this code with NARROW_BYTES = 64 << 20 (a1's rule): the E2B's staggered requests (piecewise
#          steps against the compiled module, tokens against eager); batch 1 of the E2B and the E4B against a2 (ab/a2: the narrow weights' bound
#          at 32 MB instead of 64, so the E2B's wide-MLP down_proj and the E4B's down_proj go to cuBLAS), one
#          each; the 31B at batch 1 once; the 26B-A4B at batch 1 (bench.moe), base against this code.
#   confirm  this code with a2's bound (32 MB, kept): the E4B and the E2B at batch 1, base against it, one
#          each; the 26B-A4B at batch 1 once.
#
#     git archive --prefix=ab/base/g4rt/ 1d0d673 | tar -x   # other arms: this tree, the constant edited
#     bash export/results/s13_h200.sh PART [budget_s]       # default 560 s; results under $OUT; carry ab
PART=${1:?PART: gemv, ab31, final or confirm}
BUDGET=${2:-560}
TAG=s13-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
small=(--skip-hf --batches 1 --new-tokens 32 --profile)
case $PART in
  gemv)
    run_part check 90 python3 - <<'PY'
import torch
from g4rt.plugins import triton_gemv as tg
dev = torch.device("cuda")
torch.manual_seed(0)
shapes = [(2560, 1536), (5120, 1536), (1536, 2048), (1536, 4096), (12288, 1536), (24576, 1536), (1536, 6144),
          (1536, 12288), (256, 1536), (1536, 256), (8960, 1536), (262144, 1536), (16384, 5376), (5376, 8192),
          (43008, 5376), (5376, 21504)]
worst = 0.0
for n, k in shapes:
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    for m in (1, 8):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        want = x.float() @ w.float().T
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        tg.gemv(x, w, tg.gemv_config(n, dev), out=out)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
        print(f"[{n} x {k}] rows {m}: config {tg.gemv_config(n, dev)}, prefetch {tg.prefetch_bytes(w)} B/row, "
              f"rel err {err:.2e}", flush=True)
print("worst rel err", worst)
assert worst < 1e-2, worst
PY
    grep -q "worst rel err" "$OUT/check.log" || { finish_call; exit 1; }
    for rep in 1 2; do
      for a in base a0 new; do arm $a $rep b1_e2b 75 engine --config e2b "${small[@]}"; done
    done
    arm new 1 b1_31b 120 engine --config 31b "${small[@]}"
    ;;
  ab31)
    for rep in 1 2; do
      for a in base a0 a1; do arm $a $rep b1_31b 95 engine --config 31b "${small[@]}"; done
    done
    for a in base a0; do arm $a 1 b1_e4b 60 engine --config e4b "${small[@]}"; done
    ;;
  final)
    run_part staggered_e2b 100 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null; rm -rf "$OUT/s"
    for m in e2b e4b; do
      for a in new a2; do arm $a 1 b1_$m 60 engine --config $m "${small[@]}"; done
    done
    arm new 1 b1_31b 80 engine --config 31b "${small[@]}"
    for a in base new; do arm $a 1 b1_26b 80 moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile; done
    ;;
  confirm)
    for m in e4b e2b; do
      for a in base new; do arm $a 1 b1_$m 60 engine --config $m "${small[@]}"; done
    done
    arm new 1 b1_26b 80 moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
