#!/usr/bin/env bash
# One H200 call: the service (E2B) and the engines after the piecewise steps call their attention kernels
# directly (models/paged.py attention_into), then the 31B's issue-12 targets.
#
#     bash export/results/s6_h200.sh [budget_s]        # default 570 s; results under $OUT; carry .whl/
#
# (1) runtime/results/serve_h200.sh's e2b arm (HTTP vs offline at concurrency 1-256, two series of first
#     requests); (2) E2B, eager and inductor engines: greedy tokens equal at batch 1 and on staggered
#     arrivals (mixed steps), the batch-1 decode step's kernel profile, time to first token of 128 and
#     2,048 tokens (chunk 2,048, piecewise graphs, 3 alternated reps); (3) the 31B inductor engine: time to
#     first token of 2,048 and 8,192 tokens at chunks 2,048 and 8,192, decode step wall vs replay at
#     batch 1, 64, 128, 256.
BUDGET=${1:-570}
TAG=s6
source export/results/device_call.sh
left() { echo $((BUDGET - (SECONDS - T0))); }
OUT="$OUT/serve" bash runtime/results/serve_h200.sh "$(( $(left) < 215 ? $(left) : 215 ))" e2b
run_part e2b 150 python3 -m g4rt.bench.engine --config e2b --out "$OUT/e2b" --skip-hf --batches 1 \
  --new-tokens 32 --staggered --profile --ttft 128,2048 --ttft-chunks 2048
run_part 31b 400 python3 -m g4rt.bench.engine --config 31b --out "$OUT/31b" --skip-hf --batches "" \
  --engines inductor --ttft 2048,8192 --ttft-chunks 2048,8192 --decode-steps 1,64,128,256
cat "$OUT"/e2b/export_bench.jsonl "$OUT"/31b/export_bench.jsonl > "$OUT/engine.jsonl" 2>/dev/null
for p in e2b 31b; do echo "== $p"; grep -v '"trace"' "$OUT/$p.log" 2>/dev/null | tail -40; done > "$OUT/parts.log"
rm -rf "$OUT"/e2b "$OUT"/31b "$OUT"/e2b.log "$OUT"/31b.log "$OUT/serve/gpu.txt"
ls -R "$OUT"
