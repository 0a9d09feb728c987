#!/usr/bin/env bash
# H200 calls of session 15: the two changes of session 14 (b0d4a36: the skinny matmul cut over K; 70e08f0:
# an unsplit decode at head dim 256 takes 32-key tiles over 2 warps) against the session-13 code (ab/base:
# 75f2023), a fresh process per arm, arms alternated. One PART per call:
#
#   b1     the skinny matmul's plan against an fp32 product on the E2B's, E4B's and 31B's shapes at 1 and 8
#          rows, outputs poisoned with NaN, a second launch and a CUDA-graph replay bit-equal to the first,
#          the counters left at zero; the decode attention's tiles at batch 64-256 and context 200
#          (`bench.kernels --decode-batch`); the E2B's staggered requests (piecewise steps against the
#          compiled module, tokens against eager); batch 1 of the E4B and the E2B, base and new, three
#          processes per arm.
#   steps  the 31B's decode steps at batch 1, 64, 128 and 256 (`bench.engine --decode-steps`: step wall
#          against graph replay, 3 repetitions per process), base and new, two processes per arm.
#   ttft   a third process per arm of `steps`, then the 31B's time to first token at 2,048 and 8,192 tokens
#          (chunks 2,048 and 8,192, 3 repetitions), new only.
#   moe    batch 1 of the 26B-A4B (`bench.moe`), base and new, two processes per arm (its full layers'
#          o_proj now cut over K, its sliding decode on the small tile); the E2B's third new process of `b1`.
#
#     git archive --prefix=ab/base/g4rt/ 75f2023 | tar -x    # the base arm
#     bash export/results/s15_h200.sh PART [budget_s]       # default 560 s; results under $OUT
PART=${1:?PART: b1, steps, ttft or moe}
BUDGET=${2:-560}
TAG=s15-$PART
mkdir -p "${OUT:?OUT must name the results directory}"
source export/results/device_call.sh
case $PART in
  b1)
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
    grep -q "worst rel err" "$OUT/check.log" && cp "$OUT/check.log" "$OUT/check.txt" || { finish_call; exit 1; }
    run_part decode_batch 150 python3 -m g4rt.bench.kernels --out "$OUT/db" --decode-batch
    mv "$OUT/db/results.json" "$OUT/decode_batch.json" 2>/dev/null; rm -rf "$OUT/db"
    run_part staggered_e2b 100 python3 -m g4rt.bench.engine --config e2b --out "$OUT/s" --skip-hf --batches 1 \
      --new-tokens 16 --staggered
    cat "$OUT/s/export_bench.jsonl" > "$OUT/staggered_e2b.jsonl" 2>/dev/null; rm -rf "$OUT/s"
    small=(--skip-hf --batches 1 --new-tokens 32 --profile)
    for rep in 1 2 3; do
      for m in e4b e2b; do
        for a in base new; do arm $a $rep b1_$m 60 engine --config $m "${small[@]}"; done
      done
    done
    ;;
  steps|ttft)
    reps=(1 2); [ $PART = ttft ] && reps=(3)
    for rep in "${reps[@]}"; do
      for a in base new; do
        arm $a $rep steps_31b 140 engine --config 31b --skip-hf --batches "" --engines inductor \
          --decode-steps 1,64,128,256 --reps 3
      done
    done
    [ $PART = ttft ] && arm new 1 ttft_31b 300 engine --config 31b --skip-hf --batches "" --engines inductor --ttft 2048,8192 \
      --ttft-chunks 2048,8192 --reps 3
    ;;
  moe)
    for rep in 1 2; do
      for a in base new; do
        arm $a $rep b1_26b $((rep == 1 ? 180 : 130)) moe --config 26b-a4b --batches 1 --ttft "" --skip-hf --profile
      done
    done
    arm new 3 b1_e2b 60 engine --config e2b --skip-hf --batches 1 --new-tokens 32 --profile
    ;;
  *) echo "unknown PART $PART"; exit 2 ;;
esac
finish_call
