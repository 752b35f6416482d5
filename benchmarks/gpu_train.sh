#!/usr/bin/env bash
# Train the shipped draft's recipe on one lent GPU (recipes/smollm2-135m-dspark-gpu.toml), then
# measure it: teacher-forced τ on MT-Bench and HumanEval, greedy, γ = 5. Results under $OUT.
#
# The embedded target's GGUF (93 MB) cannot travel in one device call (64 MiB with the repo), so
# benchmarks/gpu_prepare.sh --with-target cuts it into .gguf/part-* (ignored) and fetches the
# `gguf` wheel; then, on ONE warm machine, one call per part (each call carries its part):
#     call k < last:  carry [".gguf/part-K"]          command: bash benchmarks/gpu_train.sh stash
#     last call:      carry [".gguf/part-LAST", ".gguf/sha256", ".whl"]  command: bash benchmarks/gpu_train.sh run
# `stash` copies the part to /tmp/dsparkctl-gguf (kept while the machine stays warm: 30 s between
# calls); `run` reassembles, checks the sha256 that gpu_prepare.sh recorded, trains and evaluates.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/gpu-out}
mkdir -p "$OUT" /tmp/dsparkctl-gguf
PY=${PYTHON:-python3}
cp .gguf/part-* /tmp/dsparkctl-gguf/ 2>/dev/null
[ "${1:-run}" = "stash" ] && { ls -la /tmp/dsparkctl-gguf; exit 0; }
cat /tmp/dsparkctl-gguf/part-* > /tmp/dsparkctl-gguf/model.gguf
want=$(cat .gguf/sha256 2>/dev/null || cat /tmp/dsparkctl-gguf/sha256 2>/dev/null)
got=$(sha256sum /tmp/dsparkctl-gguf/model.gguf | cut -d' ' -f1)
[ "$want" = "$got" ] || { echo "reassembled GGUF does not match ($got != $want): a part is missing"; exit 1; }
export DSPARKCTL_EMBEDDED_GGUF=/tmp/dsparkctl-gguf/model.gguf PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/dsparkctl-site .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/dsparkctl-site"
fi
D="$PY -m dsparkctl"
"$PY" benchmarks/provenance.py benchmarks/gpu_train.sh --out "$OUT/provenance.json" || true  # no .git here: set DSPARKCTL_GIT_REVISION
timeout 900 $D train recipes/smollm2-135m-dspark-gpu.toml --device cuda --out "$OUT/draft" --json \
  > "$OUT/train.json" 2> "$OUT/train.log" || { tail -20 "$OUT/train.log"; exit 1; }
timeout 600 $D eval-acceptance --draft "$OUT/draft" --device cuda --dtype fp32 --dataset mt-bench --dataset humaneval \
  --mode teacher-forced --temperature 0 --max-new-tokens 128 --out "$OUT/eval.json" --json > /dev/null \
  2> "$OUT/eval.log" || { tail -20 "$OUT/eval.log"; exit 1; }
"$PY" - "$OUT" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/eval.json"))
for ds, r in d["datasets"].items():
    for label, x in r["drafts"].items():
        print(f"{ds}: teacher-forced τ {x['teacher_forced']['tau']:.3f}")
PY
