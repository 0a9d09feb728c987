#!/usr/bin/env bash
# Issue 12 on one H200 in one device call of at most 9 minutes. From the checkout root:
#
#     bash export/results/i12_h200.sh [budget_s]        # default 520 s; results under $OUT
#
# (a) the sampler, old torch sampler vs the Triton kernel, 1/64/256 rows x 262,144 (bench/kernels.py
#     --sampler: outputs checked against the reference first, arms alternated 3 times, min/median/max);
# (b) E2B batch-1 decode, inductor compile scope "layers" vs "step", a fresh process per arm, arms
#     alternated (L S L S L S) while the budget lasts, each record with its honest roofline;
# (c) the 31B batch-256 decode step profiled by kernel kind (--profile: graph replay, compiled and
#     eager step per kernel kind), HF skipped.
# Order: a, L, c, S, L, S, L, S. Every part runs under `timeout` capped by what is left of the budget,
# so one failing or slow arm costs only its own slot; a part that no longer fits is skipped and says so.
# Estimates (export/results): a ~100 s (about 40 Triton compiles of ~1 s for the tile sweep); E2B
# "layers" process ~40 s; 31B profile ~90 s (build ~5 s, compile of the layer pieces and capture
# ~20 s, two generates of 256 x (128 + 8) tokens, profile); E2B "step" unknown: the 31B's 60 layers
# took 404 s to compile as one graph, so the first "step" process may take ~4 min and later ones
# less (Inductor's on-disk cache is warm by then).
set -u
: "${OUT:?OUT must name the results directory}"
BUDGET=${1:-520}
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/g4rt
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1
mkdir -p "$OUT"
T0=$SECONDS
STATUS="$OUT/status.txt"

part() {  # part NAME CAP_S COMMAND...: run COMMAND under min(CAP_S, what is left), log to $OUT/NAME.log
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - (SECONDS - T0) - 15))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 30 ]; then
    echo "[i12] $(date +%T) skip $name: $((BUDGET - (SECONDS - T0))) s of the budget left" | tee -a "$STATUS"
    return 0
  fi
  echo "[i12] $(date +%T) start $name (limit ${limit} s, at $((SECONDS - T0)) s)"
  local s=$SECONDS
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "[i12] $(date +%T) end $name: rc $rc after $((SECONDS - s)) s" | tee -a "$STATUS"
  grep -v '"trace"' "$OUT/$name.log" | tail -n 4 | cut -c1-400
}

e2b() {  # e2b SCOPE REP
  part "e2b_$1_$2" "$3" python3 -m g4rt.bench.engine --config e2b --out "$OUT/e2b_$1_$2" --skip-hf --batches "" \
    --decode-steps 1 --compile-scope "$1"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
part sampler 180 python3 -m g4rt.bench.kernels --out "$OUT/sampler" --sampler --sampler-rows 1,64,256 --reps 3
e2b layers 1 120
part p31_b256 220 python3 -m g4rt.bench.engine --config 31b --out "$OUT/p31_b256" --skip-hf --engines inductor \
  --batches 256 --prompt-len 128 --new-tokens 8 --profile
e2b step 1 600
e2b layers 2 120
e2b step 2 600
e2b layers 3 120
e2b step 3 600

python3 - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import glob, json, os, sys

out = sys.argv[1]


def records(path):
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except OSError:
        return []


print("== (a) sampler, ms per call: min / median / max of 3 alternated reps (graph_ms: kernel alone)")
try:
    res = json.load(open(os.path.join(out, "sampler", "sampler.json")))
    for r in res["sampler"]:
        print(f"rows {r['rows']:>3} {r['kind']:<20} old {r['old_ms']} new {r['new_ms']} graph {r['graph_ms']} "
              f"x{r['speedup_median']} mismatches {r['mismatches']}/{r['rows']} correct {r['correct']}")
        for tile in r.get("tiles", []):
            print(f"      block {tile['block']} warps {tile['num_warps']}: graph {tile['graph_ms']} same {tile['same_tokens']}")
except (OSError, KeyError, ValueError) as e:
    print("no sampler results:", e)

print("== (b) E2B batch 1, overlapped loop: step wall / replay ms, tok/s, honest roofline tok/s")
for d in sorted(glob.glob(os.path.join(out, "e2b_*"))):
    if not os.path.isdir(d):
        continue
    recs = records(os.path.join(d, "export_bench.jsonl"))
    steps = [r for r in recs if r.get("stage") == "decode_steps" and r.get("overlap")]
    errors = [r["error"][:200] for r in recs if "error" in r]
    if steps:
        walls = sorted(r["step_wall_ms_median"] for r in steps)
        r = steps[len(steps) // 2]
        print(f"{os.path.basename(d):<16} wall {walls} replay {[s['replay_ms'] for s in steps]} "
              f"tok/s {[s['tok_s_total'] for s in steps]} roofline {r['roofline_tok_s_total']} "
              f"of roofline {[s['of_roofline'] for s in steps]} captures_in_window {[s['captures_in_window'] for s in steps]}")
    else:
        print(f"{os.path.basename(d):<16} no decode_steps record", errors)

print("== (c) 31B batch 256 decode step by kernel kind")
for r in records(os.path.join(out, "p31_b256", "export_bench.jsonl")):
    if r.get("stage") == "inductor":
        print("inductor run:", {k: r.get(k) for k in ("decode_tok_s_total", "of_roofline", "warmup_s", "stage_s")})
    if r.get("stage") == "decode_profile":
        print("replay ms median", r["replay_ms_median"], "min", r["replay_ms_min"], "matmul GB/s", r.get("matmul_GBps"))
        for name in ("compiled", "eager"):
            p = r[name]
            print(f"  {name}: {p['kernels']} kernels, {p['kernel_ms']} ms:",
                  ", ".join(f"{k} {v['ms']} ms ({v['count']})" for k, v in p["by_kind"].items()))
        for n, ms in r["compiled"]["top"]:
            print(f"    {ms:8.3f} ms  {n}")
    if "error" in r:
        print("error:", r.get("stage"), r["error"][:300])
EOF
echo "[i12] $(date +%T) done in $((SECONDS - T0)) s"
