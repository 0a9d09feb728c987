#!/bin/bash
# One H200 call (<= 9 min): g4rt serve (random checkpoint, inductor engine, the engine in its own process)
# under `g4rt bench serve`, then the same workloads (same prompts, same seed) offline through the same
# warmed-up LLM in the service's engine process, at concurrency 1,8,64,256, for each arm of ARMS in turn:
# e2b, e4b, 31b (E2B_SWEEPS sweeps for the small models, 3 for the 31B), each optionally followed by
# @FLAG,FLAG... (more `bench serve host` flags, e.g. e2b@--chunk=256) or %TREE (host and client run the
# package copied into the folder TREE, e.g. another commit's `git archive` in an ignored folder the call
# carries), for an A/B in one call; such an arm's results go to $OUT/<model>-<its position in ARMS>/.
# An arm starts only if the time left allows.
# Run from the repository root with the serve extra's wheels in .whl/ (the image lacks fastapi,
# starlette, pydantic, uvicorn); everything lands in $OUT/<arm>/.
# Each arm has its own time limit, and each point is appended to its file as soon as it is measured, so
# a failing or slow arm loses only its own unfinished points.
#   bash runtime/results/serve_h200.sh [BUDGET_S] [ARMS] [E2B_SWEEPS]    defaults: 530 s, "e2b 31b", 3
#   e.g. bash runtime/results/serve_h200.sh 470 "e2b e2b@--chunk=256" 3
#        bash runtime/results/serve_h200.sh 530 "e2b%ab/old e2b e2b%ab/old e2b" 1
# .whl/ (git-ignored; ~8 MB), for the image's Python 3.12:
#   pip download -d .whl --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     fastapi starlette pydantic pydantic-core annotated-types typing-extensions typing-inspection \
#     opentelemetry-api uvicorn httptools uvloop
START=$SECONDS
BUDGET=${1:-530}  # seconds for the whole call (a 9-minute device call, less its own start-up)
ARMS=${2:-e2b 31b}
E2B_SWEEPS=${3:-3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || { echo "wheels did not install"; exit 1; }
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/g4rt && export PYTHONPATH=/tmp/pkg:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-artifacts/serve}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt"
left() { echo $((BUDGET - (SECONDS - START))); }
say() { echo "[$((SECONDS - START)) s] $*"; }

# arm NAME LIMIT_S "HOST FLAGS" "WORKLOAD FLAGS" [TREE]: serve, sweep over HTTP, SIGTERM (drain, then offline).
arm() {
  local name=$1 limit=$2 hostargs=$3 w=$4 d="$OUT/$1" url="" host
  mkdir -p "$d"
  local PYTHONPATH=$PYTHONPATH
  if [ -n "$5" ]; then  # this arm's package: TREE as g4rt, ahead of the checkout's
    mkdir -p "/tmp/tree-$name" && ln -sfn "$PWD/$5" "/tmp/tree-$name/g4rt" && PYTHONPATH=/tmp/tree-$name:$PYTHONPATH
    say "$name: the package in $5"
  fi
  say "$name: starting the host (limit $limit s)"
  timeout -s KILL "$limit" python3 -m g4rt.bench.serve host $hostargs $w --out "$d/offline.jsonl" > "$d/host.log" 2>&1 &
  host=$!
  local end=$((SECONDS + limit))
  while [ -z "$url" ] && kill -0 $host 2>/dev/null; do
    url=$(grep -o "http://[0-9.:]*" "$d/host.log" | head -1); sleep 0.5
  done
  while [ -n "$url" ] && ! curl -sf "$url/ready" > /dev/null && kill -0 $host 2>/dev/null; do sleep 0.5; done
  if ! curl -sf "$url/ready" > "$d/ready.json"; then
    say "$name: the host never became ready"; kill -TERM $host 2>/dev/null; wait $host
    echo "host exit $?" >> "$d/host.log"; tail -20 "$d/host.log"
    local engine=$(grep -o "engine process [0-9]*" "$d/host.log" | head -1 | cut -d" " -f3)
    [ -n "$engine" ] && kill -KILL "$engine" 2>/dev/null
    return 1
  fi
  say "$name: ready ($(grep -o '"warmup_s":[0-9.]*' "$d/ready.json"))"; rm -f "$d/ready.json"
  # the offline arm runs after the drain and takes about as long as the HTTP sweep: give each half
  local sweep=$(( (end - SECONDS) / 2 )); [ "$sweep" -lt 5 ] && sweep=5  # (timeout 0 would mean none)
  # the first ten sequential requests after readiness, then five with the server idle for 1 s before each
  timeout 30 python3 -m g4rt.bench.serve --url "$url" $w --first-requests 10 --concurrency "" --out "$d/serve.jsonl" \
    | cut -c1-160
  timeout 30 python3 -m g4rt.bench.serve --url "$url" $w --first-requests 5 --idle-gap 1 --concurrency "" \
    --out "$d/serve.jsonl" | cut -c1-160
  timeout "$sweep" python3 -m g4rt.bench.serve --url "$url" $w --num-prompts 10 --out "$d/serve.jsonl" | cut -c1-160
  say "$name: HTTP sweep exit ${PIPESTATUS[0]}"
  local metrics=$(curl -s "$url/metrics" | grep -E "^(g4rt_((step_seconds|time_to_first_token_seconds|request_queue_time_seconds)_(sum|count)|step_seconds_bucket|compiles_after_ready_total)|process_cpu_seconds_total)")
  kill -TERM $host; wait $host; echo "host exit $?" | tee -a "$d/host.log"
  echo "$metrics" >> "$d/host.log"  # three files per arm: the device returns at most 8
  # a host killed by its time limit leaves its engine process (running the offline arm) behind: end it
  local engine=$(grep -o "engine process [0-9]*" "$d/host.log" | head -1 | cut -d" " -f3)
  [ -n "$engine" ] && kill -0 "$engine" 2>/dev/null && kill -KILL "$engine" && say "$name: killed the engine process $engine"
  say "$name: done; $(cat "$d/serve.jsonl" 2>/dev/null | wc -l) HTTP and $(cat "$d/offline.jsonl" 2>/dev/null | wc -l) offline records"
  grep -E "warm-up done|draining|Traceback|Error" "$d/host.log" | head -8
}

# E2B (h200_serve_final_e2b_host.log): build 12 s, warm-up (126 decode graphs, 12 piecewise buckets, the sampler
# at 1..256 rows) 114 s, HTTP sweep 21 s, offline 23 s; an arm of 5 sweeps fits in 270 s. The 31B
# (h200_serve_final_31b_host.log, one sweep): build 10 s, warm-up 67 s, HTTP sweep 21 s, offline 20 s.
HOST="--max-num-seqs 256 --max-model-len 256 --chunk 512"
LOAD="--input-len 128 --output-len 32 --len-spread 0.25 --vocab 262144 --concurrency 1,8,64,256"
n=0
for a in $ARMS; do
  n=$((n + 1)); tree=""; [[ $a == *%* ]] && tree=${a#*%} && a=${a%%\%*}
  model=${a%%@*}; flags=""; name=$model
  [ "$a" != "$model" ] && flags=${a#*@} && flags=${flags//,/ }
  [ -n "$flags$tree" ] && name=$model-$n
  case $model in
    e2b|e4b) need=200; cap=270; host="--config $model $HOST --kv-gib 16 $flags"; w="--waves 6 $LOAD --repeat $E2B_SWEEPS" ;;
    31b) need=200; cap=100000; host="--config 31b $HOST --kv-gib 48 $flags"; w="--waves 2 $LOAD --repeat 3" ;;
    *) say "unknown arm $a"; continue ;;
  esac
  if [ "$(left)" -lt "$need" ]; then say "$a: skipped, $(left) s left (needs >= $need)"; continue; fi
  limit=$(( $(left) - 5 )); [ "$limit" -gt "$cap" ] && limit=$cap
  arm "$name" "$limit" "$host" "$w" "$tree"
done
say "all done"
