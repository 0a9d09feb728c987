# Sourced by the device-call scripts here (pw_h200.sh, s6, s8, s9, s10) after they set BUDGET (seconds for
# the whole call) and TAG (their log prefix): checks OUT, links this checkout as the package `g4rt`,
# starts the call's clock (T0) and defines
# run_part NAME CAP_S COMMAND...: run COMMAND with at most CAP_S seconds, and no more than the call's
# budget leaves (less 10 s), its output in $OUT/NAME.log; print the records' stages when it ends.
set -u
: "${OUT:?OUT must name the results directory}"
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/g4rt
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1
T0=$SECONDS
run_part() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - T0) - 10)); local limit=$((cap < left ? cap : left))
  [ "$limit" -lt 30 ] && { echo "[$TAG] skip $name"; return 0; }
  echo "[$TAG] $(date +%T) start $name (limit $limit s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "[$TAG] $(date +%T) end $name: rc $? at $((SECONDS - T0)) s"
  grep -v '"trace"' "$OUT/$name.log" | grep '"stage"' | cut -c1-300 | tail -8
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
