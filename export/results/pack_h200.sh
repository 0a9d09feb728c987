#!/usr/bin/env bash
# One H200 call: the 31B behind `g4rt serve` (runtime/results/serve_h200.sh's 31b arm), then the E2B's
# batch-1 decode with each dense MLP's gate and up packed into one weight (this checkout) against the
# same code with them unpacked (a copy of this checkout's package in which pack_weights does not call
# MLP.pack_gate_up), arms alternated, each a fresh process: eager and inductor greedy tokens, the decode
# graph's replay time and its kernels (bench.engine --profile).
#
#     bash export/results/pack_h200.sh [budget_s]      # default 560 s; results under $OUT; carry .whl/
BUDGET=${1:-560}
TAG=pack
source export/results/device_call.sh
left() { echo $((BUDGET - (SECONDS - T0))); }
OUT="$OUT/serve" bash runtime/results/serve_h200.sh "$(( $(left) - 230 ))" 31b
mkdir -p /tmp/unpacked/g4rt && cp -r __init__.py bench cli.py export models plugins runtime /tmp/unpacked/g4rt/
sed -i '/layer.mlp.pack_gate_up()/d' /tmp/unpacked/g4rt/models/model.py
grep -c "pack_gate_up()" /tmp/unpacked/g4rt/models/model.py models/model.py
for rep in 1 2; do
  for arm in unpacked packed; do
    pp=/tmp/pkg; [ $arm = unpacked ] && pp=/tmp/unpacked
    PYTHONPATH=$pp run_part "e2b_${arm}_$rep" 110 python3 -m g4rt.bench.engine --config e2b \
      --out "$OUT/e2b_${arm}_$rep" --skip-hf --batches 1 --new-tokens 32 --profile
    python3 -c "import json,sys; [print(json.dumps({'arm': sys.argv[1], 'rep': int(sys.argv[2]), **json.loads(l)}))
      for l in open(sys.argv[3])]" $arm $rep "$OUT/e2b_${arm}_$rep/export_bench.jsonl" >> "$OUT/e2b_pack.jsonl"
  done
done
for f in "$OUT"/e2b_*_*.log; do echo "== $f"; grep -v '"trace"' "$f" | grep -v '"stage"' | tail -5; done > "$OUT/pack_parts.log"
rm -rf "$OUT"/e2b_*_[12] "$OUT"/e2b_*_[12].log "$OUT/serve/gpu.txt"
ls -R "$OUT"
