#!/usr/bin/env bash
# H200 calls of session 14. One PART per call:
#
#   measure  where the 31B's batch-128 decode step goes and what its matmuls cost role by role: the
#            31B's matmul roles at batches 64 and 128 (`bench.engine --matmuls`: cuBLAS on every layout);
#            one inductor run at batch 128 with the decode profile (kernels by kind, replay); the E4B's
#            matmul roles at batch 1 (cuBLAS, the skinny matmul's configs and the op's own choice).
#   sweep    the skinny matmul cut over K (gemv_plan): first against an fp32 product on the E2B's, E4B's and
#            31B's shapes with the op's plan, at 1 and 8 rows, outputs poisoned with NaN, a second launch and a
#            CUDA-graph replay bit-equal to the first; the decode attention's tiles at batch 64-256 and context
#            200 (`bench.kernels --decode-batch`); the E4B's and E2B's matmul roles at batch 1 (every tile,
#            unsplit and split); then batch 1 of the E4B, the E2B and the 31B, base (ab/base: 1362153, the
#            op's tiles of session 13, no split) against this code, alternated, one process each.
#   steps    the 31B's decode steps at batch 64, 128 and 256 (`bench.engine --decode-steps`, step wall against
#            graph replay), s1 (ab/s1: b0d4a36, the split skinny matmul with session 13's decode tiles)
#            against this code (an unsplit decode at head dim 256 takes 32-key tiles over 2 warps); the E2B's
#            staggered requests with this code (piecewise steps against the compiled module, tokens against
#            eager); a second batch-1 process per arm of the E4B and the E2B, base against this code.
#
#     git archive --prefix=ab/base/g4rt/ REV | tar -x        # the base arm (ab/s1 likewise)
#     bash export/results/s14_h200.sh PART [budget_s]       # default 560 s; results under $OUT
PART=${1:?PART: measure, sweep or steps}
BUDGET=${2:-560}
TAG=s14-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  measure)
    arm new 1 matmuls_31b 150 engine --config 31b --skip-hf --matmuls --batches 64,128
    arm new 1 profile_31b_b128 200 engine --config 31b --skip-hf --batches 128 --new-tokens 32 \
      --engines inductor --profile
    arm new 1 matmuls_e4b 90 engine --config e4b --skip-hf --matmuls --batches 1
    ;;
  sweep)
    run_part check 90 python3 - <<'PY'
import torch
from g4rt.plugins import triton_gemv as tg
dev = torch.device("cuda")
torch.manual_seed(0)
shapes = [(1536, 6144), (1536, 12288), (1536, 4096), (2560, 10240), (2560, 4096), (2560, 2048), (3072, 2560),
          (2048, 2560), (5376, 8192), (5376, 21504), (5376, 16384), (2560, 1536), (5120, 1536), (256, 1536)]
worst = 0.0
for n, k in shapes:
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    config, splits = tg.gemv_plan(n, k, dev)
    for m in (1, 8):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        want = x.float() @ w.float().T
        out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        tg.gemv(x, w, config, out=out, splits=splits)
        again = tg.gemv(x, w, config, splits=splits)
        graph_out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            tg.gemv(x, w, config, out=graph_out, splits=splits)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        same = torch.equal(out, again) and torch.equal(out, graph_out)
        worst = max(worst, err)
        print(f"[{n} x {k}] rows {m}: plan {config} x {splits}, rel err {err:.2e}, bit-equal again/graph {same}",
              flush=True)
        assert same, (n, k, m)
assert not tg._locks(dev).any(), "counters left non-zero"
print("worst rel err", worst)
assert worst < 1e-2, worst
PY
    grep -q "worst rel err" "$OUT/check.log" || { finish_call; exit 1; }
    run_part decode_batch 150 python3 -m g4rt.bench.kernels --out "$OUT/db" --decode-batch
    mv "$OUT/db/results.json" "$OUT/decode_batch.json" 2>/dev/null; rm -rf "$OUT/db"
    for m in e4b e2b; do arm new 1 matmuls_$m 70 engine --config $m --skip-hf --matmuls --batches 1; done
    small=(--skip-hf --batches 1 --new-tokens 32 --profile)
    for m in e4b e2b 31b; do
      for a in base new; do arm $a 1 b1_$m 75 engine --config $m "${small[@]}"; done
    done
    ;;
  steps)
    for a in s1 new; do
      arm $a 1 steps_31b 175 engine --config 31b --skip-hf --batches "" --engines inductor --decode-steps 64,128,256 \
        --reps 1
    done
    run_part staggered_e2b 100 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null; rm -rf "$OUT/s"
    small=(--skip-hf --batches 1 --new-tokens 32 --profile)
    for m in e4b e2b; do
      for a in base new; do arm $a 2 b1_$m 60 engine --config $m "${small[@]}"; done
    done
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
