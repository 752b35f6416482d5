#!/usr/bin/env bash
# The one prepared device check (run by the device tool in the repo root; results under $OUT).
# Uses the machine's own python3 with its torch/transformers; installs nothing from a registry:
# only the wheels benchmarks/gpu_prepare.sh put in .whl/ (carried), with --no-index.
#   device call:  carry [".whl"], command "bash benchmarks/gpu_check.sh", timeout_s 540
#   dry run here: DSPARKCTL_GPU_DRYRUN=1 PYTHON=<venv>/bin/python bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dsparkctl-site \
    .whl/*.whl > "$OUT/install.log" 2>&1 || { echo "installing the carried wheels failed"; tail -5 "$OUT/install.log"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/dsparkctl-site"
fi
# our package runs from the source tree (PYTHONPATH); `python -m dsparkctl` is the CLI
"$PY" -c "import dsparkctl, torch, transformers, typer, rich, safetensors; print('imports ok')" \
  || { echo "a package the check needs is missing; add it to benchmarks/gpu_prepare.sh"; exit 1; }
timeout 500 "$PY" benchmarks/gpu_check.py 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
