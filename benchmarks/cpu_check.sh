#!/usr/bin/env bash
# The engine's CPU figures in one sequential run (run it on a quiet machine: these are wall clocks).
#   1. profile-sps on SmolLM2 for batch tokens 1..64 (wall time; table + PNG)
#   2. share of round time outside the two models' forwards, and the Markov loop's share (batch 1, 8)
#   3. generate --baseline on HumanEval prompts, greedy, default models, under static:γ, static:2
#      and dspark (the profiled SPS table): speculative vs plain tokens/s in the same run
# Usage: bash benchmarks/cpu_check.sh [LIMIT]      (writes benchmarks/results/*)
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=${1:-20}
R=benchmarks/results
D=.venv/bin/dsparkctl
mkdir -p "$R"
# the files the CLI writes below carry no git revision: this sidecar does
.venv/bin/python benchmarks/provenance.py benchmarks/cpu_check.sh --out "$R/cpu_check.provenance.json"
s=$(date +%s.%N)
$D profile-sps --out "$R/sps_smollm2_cpu.json" --json > "$R/profile_sps.json"
e=$(date +%s.%N)
python3 -c "print(f'profile-sps wall: {${e}-${s}:.1f} s')" | tee "$R/cpu_check.txt"
.venv/bin/python benchmarks/bench_engine_overhead.py | tee -a "$R/cpu_check.txt"
for pol in static:5 static:2 dspark; do
  extra=()
  [ "$pol" = dspark ] && extra=(--sps-table "$R/sps_smollm2_cpu.json")
  $D generate --dataset humaneval --limit "$LIMIT" --batch-size 1 --max-new-tokens 128 --baseline --json \
     --policy "$pol" "${extra[@]}" > "$R/generate_humaneval_${pol/:/}.json"
  .venv/bin/python - "$R/generate_humaneval_${pol/:/}.json" <<'PY' | tee -a "$R/cpu_check.txt"
import json, sys
r = json.load(open(sys.argv[1]))
b = r["baseline"]
print(f"generate --baseline humaneval[{r['prompts']}] {r['policy']}: tau {r['acceptance']['tau']:.2f}, "
      f"speculative {r['tokens_per_s']:.1f} tok/s vs plain {b['tokens_per_s']:.1f} tok/s = {r['speedup']:.2f}x; "
      f"greedy identical {b.get('identical_outputs')}/{r['prompts']}")
PY
done
