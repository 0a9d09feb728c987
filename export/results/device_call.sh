# Sourced by the device-call scripts here (pw_h200.sh and the sNN_h200.sh scripts) after they set BUDGET (seconds for
# the whole call) and TAG (their log prefix): checks OUT, links this checkout as the package `g4rt`,
# starts the call's clock (T0), writes the GPU's clock limits and power cap to $OUT/gpu.csv and defines
# run_part NAME CAP_S COMMAND...: run COMMAND with at most CAP_S seconds, and no more than the call's
# budget leaves (less 10 s), its output in $OUT/NAME.log; print the records' stages when it ends.
set -u
: "${OUT:?OUT must name the results directory}"
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/g4rt
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1
T0=$SECONDS
# the machine's clock limits and power cap: machines of the pool differ at the same copy bandwidth
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.applications.graphics,clocks.max.mem,power.limit,power.max_limit \
  --format=csv > "$OUT/gpu.csv" 2>&1 || true
run_part() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - T0) - 10)); local limit=$((cap < left ? cap : left))
  [ "$limit" -lt 30 ] && { echo "[$TAG] skip $name"; return 0; }
  echo "[$TAG] $(date +%T) start $name (limit $limit s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?  # before any other command: 124 or 137 where the limit ended it
  echo "[$TAG] $(date +%T) end $name: rc $rc at $((SECONDS - T0)) s"
  grep -v '"trace"' "$OUT/$name.log" | grep '"stage"' | cut -c1-300 | tail -8
}
# run_arm PKG ARM REP NAME CAP BENCH ARGS...: `python -m g4rt.bench.BENCH --out DIR ARGS` with the package
# in PKG (a folder holding g4rt/: this checkout's /tmp/pkg, or a `git archive` of another commit), its
# records tagged with the arm and the repetition (the process), appended to $OUT/NAME.jsonl; a record's own `arm`
# or `rep` is kept as `bench_arm` / `bench_rep`, so neither the tag nor the bench's field is lost.
run_arm() {
  local pkg=$1 arm=$2 rep=$3 name=$4 cap=$5 bench=$6 d="$OUT/${4}_${2}_$3"; shift 6
  [ -d "$pkg/g4rt" ] || { echo "[$TAG] no $pkg/g4rt: git archive it first"; return 1; }
  PYTHONPATH=$pkg run_part "${name}_${arm}_$rep" "$cap" python3 -m "g4rt.bench.$bench" --out "$d" "$@"
  for f in "$d"/*.jsonl; do
    python3 -c "import json,sys; t = {'arm': sys.argv[1], 'rep': int(sys.argv[2])}
[print(json.dumps({**t, **{'bench_' + k if k in t else k: v for k, v in json.loads(l).items()}}))
 for l in open(sys.argv[3])]" "$arm" "$rep" "$f" >> "$OUT/$name.jsonl"
  done
  rm -rf "$d"
}
# arm ARM REP NAME CAP BENCH ARGS...: run_arm with this checkout's package for ARM `new`, else ab/ARM's (a
# `git archive --prefix=ab/ARM/g4rt/ REV` the call carries).
arm() { local pkg=/tmp/pkg; [ "$1" != new ] && pkg=$PWD/ab/$1; run_arm "$pkg" "$@"; }
# each_arm ARMS NAME CAP BENCH ARGS...: `arm` for each of the (space-separated) ARMS in turn, numbered from 1.
each_arm() {
  local arms=$1 a n=0; shift
  for a in $arms; do
    n=$((n + 1))
    arm "$a" "$n" "$@"
  done
}
# gpu_tests "TREE:TESTFILE[,TESTFILE] ...": each TREE's test files (TREE `new` = this checkout, else ab/TREE/g4rt), a
# part each of at most 200 s, stopping at a tree's first failure; the last lines of each log printed. TRITON_INTERPRET=0:
# the test files that also run under the interpreter on CPU default it to 1, which would skip their GPU cases.
gpu_tests() {
  local t d p f
  for t in $1; do
    d=$PWD p=/tmp/pkg; [ "${t%%:*}" != new ] && d=$PWD/ab/${t%%:*}/g4rt p=$PWD/ab/${t%%:*}
    f=${t#*:}
    (cd "$d" && TRITON_INTERPRET=0 PYTHONPATH=$p run_part "gpu_tests_${t%%:*}" 200 python3 -m pytest -q -x -p no:cacheprovider ${f//,/ })
    tail -3 "$OUT/gpu_tests_${t%%:*}.log"
  done
}
# batch1 CAP DEFAULT_MODELS DEFAULT_ARMS: batch-1 decode of each of $MODELS, arms $ARMS alternated (a process each,
# CAP seconds at most), records in $OUT/b1_MODEL.jsonl
batch1() {
  local cap=$1 m; local models=${MODELS:-$2} arms=${ARMS:-$3}
  for m in $models; do
    each_arm "$arms" b1_$m "$cap" engine --config $m --skip-hf --batches 1 --new-tokens 32 --profile
  done
}
# finish_call: the last lines of each part's log (less traces, records and warnings) into $OUT/parts.txt,
# the logs removed (their records are in the jsonl files), and what is left under $OUT listed.
finish_call() {
  for f in "$OUT"/*.log; do
    echo "== $f"; grep -v '"trace"' "$f" | grep -v '"stage"' | grep -v Warning | tail -5
  done > "$OUT/parts.txt"
  rm -f "$OUT"/*.log
  ls -R "$OUT"
}
