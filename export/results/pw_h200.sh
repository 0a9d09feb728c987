#!/usr/bin/env bash
# The inductor engine's piecewise graphs (runtime/engines/piecewise.py) on one H200, in one device call:
#
#     bash export/results/pw_h200.sh [budget_s]        # default 540 s; results under $OUT
#
# (1) E2B, eager and inductor engines: greedy tokens equal at batch 1 and 8 and on staggered arrivals
#     (mixed prefill + decode steps), then time to first token of 128 and 2,048 tokens (chunk 2,048),
#     3 alternated reps, with the piecewise graphs; (2) the same TTFT arms without them
#     (--no-piecewise) in a fresh process; (3) `g4rt serve` of the E2B against offline,
#     runtime/results/serve_h200.sh's e2b arm, with what is left.
BUDGET=${1:-540}
TAG=pw
source export/results/device_call.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt"
run_part e2b_pw 170 python3 -m g4rt.bench.engine --config e2b --out "$OUT/e2b_pw" --skip-hf --batches 1,8 \
  --new-tokens 32 --staggered --ttft 128,2048 --ttft-chunks 2048
run_part e2b_nopw 90 python3 -m g4rt.bench.engine --config e2b --out "$OUT/e2b_nopw" --skip-hf --batches "" \
  --engines inductor --ttft 128,2048 --ttft-chunks 2048 --no-piecewise
cat "$OUT"/e2b_pw/export_bench.jsonl "$OUT"/e2b_nopw/export_bench.jsonl > "$OUT/engine.jsonl" 2>/dev/null
rm -rf "$OUT/e2b_pw" "$OUT/e2b_nopw"
LEFT=$((BUDGET - (SECONDS - T0)))
echo "[pw] serve with $LEFT s left"
OUT="$OUT/serve" bash runtime/results/serve_h200.sh "$LEFT" e2b
# at most 8 files come back: one log of the parts, the serve arm's four
for p in e2b_pw e2b_nopw; do echo "== $p"; grep -v '"trace"' "$OUT/$p.log" 2>/dev/null | tail -40; done > "$OUT/parts.log"
rm -f "$OUT"/e2b_pw.log "$OUT"/e2b_nopw.log "$OUT/serve/gpu.txt" "$OUT/serve/e2b/ready.json"
ls -R "$OUT"
