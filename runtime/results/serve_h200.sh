#!/bin/bash
# One H200 call: g4rt serve (random E2B checkpoint, inductor engine) under `g4rt bench serve`, then the
# same workloads offline through the same warmed-up LLM. Run from the repository root with the serve
# extra's wheels in .whl/ (the image lacks fastapi, starlette, pydantic, uvicorn); results in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/g4rt && export PYTHONPATH=/tmp/pkg:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-artifacts/serve}; mkdir -p "$OUT"
W="--waves 6 --input-len 128 --output-len 32 --len-spread 0.25 --vocab 262144 --concurrency 1,8,64 --repeat 3"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt"
timeout 300 python3 -m g4rt.bench.serve host --config e2b --max-num-seqs 64 --max-model-len 512 --chunk 512 \
  --kv-gib 16 $W --out "$OUT/offline.jsonl" > "$OUT/host.log" 2>&1 &
HOST=$!
for _ in $(seq 600); do URL=$(grep -o "http://[0-9.:]*" "$OUT/host.log" | head -1); [ -n "$URL" ] && break; sleep 0.5; done
for _ in $(seq 600); do curl -sf "$URL/ready" > /dev/null && break; kill -0 $HOST || break; sleep 0.5; done
curl -s "$URL/ready" > "$OUT/ready.json"
timeout 200 python3 -m g4rt.bench.serve --url "$URL" $W --num-prompts 10 --first-requests 10 --out "$OUT/serve.jsonl"
curl -s "$URL/metrics" | grep -E "^g4rt_(step_seconds|time_to_first|request_queue)_(sum|count)" > "$OUT/metrics.txt"
kill -TERM $HOST; wait $HOST; echo "host exit $?" | tee -a "$OUT/host.log"
tail -5 "$OUT/host.log"
