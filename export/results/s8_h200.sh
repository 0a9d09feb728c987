#!/usr/bin/env bash
# One H200 call: the 31B behind `g4rt serve` (runtime/results/serve_h200.sh's 31b arm: HTTP vs offline at
# concurrency 1-256, first requests), then the 31B inductor engine's decode step wall vs graph replay at
# batch 1, 64, 128 and 256 with gate/up packed (bench.engine --decode-steps; overlapped and
# one-step-at-a-time arms alternated in one process).
#
#     bash export/results/s8_h200.sh [budget_s]        # default 560 s; results under $OUT; carry .whl/
BUDGET=${1:-560}
TAG=s8
source export/results/device_call.sh
left() { echo $((BUDGET - (SECONDS - T0))); }
OUT="$OUT/serve" bash runtime/results/serve_h200.sh "$(( $(left) < 260 ? $(left) : 260 ))" 31b
run_part 31b 290 python3 -m g4rt.bench.engine --config 31b --out "$OUT/31b" --skip-hf --batches "" \
  --engines inductor --decode-steps 1,64,128,256 --reps 2
cp "$OUT/31b/export_bench.jsonl" "$OUT/engine_31b.jsonl" 2>/dev/null
grep -v '"trace"' "$OUT/31b.log" | grep -v '"stage"' | tail -20 > "$OUT/parts.log"
rm -rf "$OUT/31b" "$OUT/31b.log" "$OUT/serve/gpu.txt"
ls -R "$OUT"
