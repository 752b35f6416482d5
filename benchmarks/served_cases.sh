#!/usr/bin/env bash
# Issue 27: the parity verdict on real rounds of the shipped pair, served through vLLM's own accounting.
#
# Offline: `eval-acceptance --mode live` on the first 40 MT-Bench questions. Served: live rounds of
# `generate --policy static:5` on the other 40, replayed through vLLM's own SpecDecodingProm (and
# its per-request metrics) by benchmarks/interop_served.py in the vLLM side venv of
# benchmarks/interop_check.sh (build it first: `bash benchmarks/interop_check.sh --build-only`):
#   agree      the same draft, template and sampling as offline
#   pos1       the draft fed the target's hidden states concatenated in another order (its `fc`
#              weight's four tap blocks reversed): what an engine that wires the taps wrongly does
#   later      the draft with its Markov head zeroed: what an engine that ignores markov_* does
#   mixed      the agreeing rounds with drafts shortened as a per-batch-size length table would:
#              vLLM's documented per-position rate beside the conditional, and the counts
# agree/pos1/later are replayed with full-length drafts (a server with a fixed K; the rounds our
# engine cut short at a request's end are left out), so every conditional is identified.
# Also tried, and NOT a mismatch with this draft (so not used): the prompts without the chat
# template (--no-chat), the taps shifted one layer down, and T = 1.0 against greedy offline.
# Each case's `dsparkctl served` output goes to benchmarks/results/served_<case>.txt.
# Usage: bash benchmarks/served_cases.sh   (about 15 min on one core; OMP_NUM_THREADS=1 is set;
#        SERVED_CASES_REUSE=1 reuses the traces of an earlier run in $SERVED_CASES_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
INTEROP_DIR=${INTEROP_DIR:-/tmp/interop}
VPY=$INTEROP_DIR/vllm-venv/bin/python
W=${SERVED_CASES_DIR:-/tmp/served_cases}
R=benchmarks/results
D=.venv/bin/dsparkctl
[ -x "$VPY" ] || { echo "no vLLM side venv at $INTEROP_DIR: run bash benchmarks/interop_check.sh --build-only"; exit 1; }
mkdir -p "$W"
N=${SERVED_CASES_TOKENS:-96}

# the prompts split in two halves, and the draft as engines that get it wrong would run it
.venv/bin/python - "$W" <<'PY'
import json, shutil, sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
from dsparkctl.data.prompts import load_prompts
from dsparkctl.models.loading import default_draft_dir
w = Path(sys.argv[1])
qs = load_prompts("mt-bench")
for name, part in (("a", qs[:40]), ("b", qs[40:])):
    (w / f"mt-bench-{name}.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in part))
for name in ("markov-off", "taps-reordered"):
    dst = w / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(default_draft_dir(), dst, ignore=shutil.ignore_patterns("calibration*"))
    t = load_file(dst / "model.safetensors")
    if name == "markov-off":
        t = {k: (v.zero_() if k.startswith("markov_head.") else v) for k, v in t.items()}
    else:
        fc = t["fc.weight"]
        t["fc.weight"] = torch.cat(list(fc.split(fc.shape[0], dim=1))[::-1], dim=1).contiguous()
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
PY
common=(--field prompt --max-new-tokens "$N" --batch-size 8 --temperature 0)
fresh() { [ "${SERVED_CASES_REUSE:-0}" != 1 ] || [ ! -s "$1" ]; }
if fresh "$W/offline.json"; then
  $D eval-acceptance --dataset "$W/mt-bench-a.jsonl" "${common[@]}" --mode live --out "$W/offline.json" > /dev/null
fi
fresh "$W/agree.jsonl" && $D generate --dataset "$W/mt-bench-b.jsonl" "${common[@]}" --policy static:5 --no-text \
    --trace "$W/agree.jsonl" > /dev/null
fresh "$W/pos1.jsonl" && $D generate --dataset "$W/mt-bench-b.jsonl" "${common[@]}" --policy static:5 --no-text \
    --draft "$W/taps-reordered" --trace "$W/pos1.jsonl" > /dev/null
fresh "$W/later.jsonl" && $D generate --dataset "$W/mt-bench-b.jsonl" "${common[@]}" --policy static:5 --no-text \
    --draft "$W/markov-off" --trace "$W/later.jsonl" > /dev/null
for c in agree pos1 later; do
  "$VPY" benchmarks/interop_served.py vllm "$W/$c.jsonl" "$W/$c" --lengths full 2> /dev/null
  { echo "\$ dsparkctl served $c/scrape_end.txt --offline offline.json"
    $D served "$W/$c/scrape_end.txt" --offline "$W/offline.json" 2>&1 || true; } | tee "$R/served_$c.txt"
done
"$VPY" benchmarks/interop_served.py vllm "$W/agree.jsonl" "$W/mixed" --lengths mixed 2> /dev/null
{ echo "\$ dsparkctl served mixed/scrape_end.txt     # vLLM's Prometheus counters, drafts of mixed lengths"
  $D served "$W/mixed/scrape_end.txt" 2>&1
  echo
  echo "\$ dsparkctl served mixed/responses_detailed.jsonl     # the same steps, vLLM's detailed per-request metrics"
  $D served "$W/mixed/responses_detailed.jsonl" 2>&1
  echo
  echo "the counts fed in (interop_served.py expected.json):"
  .venv/bin/python -c 'import json,sys; e=json.load(open(sys.argv[1]))["all"]; print(json.dumps({k: e[k] for k in ("drafts","draft_tokens","accepted_tokens","accepted_at","tested","conditional")}))' "$W/mixed/expected.json"
} | tee "$R/served_mixed.txt"
