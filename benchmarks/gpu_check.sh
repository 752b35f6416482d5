#!/usr/bin/env bash
# One prepared CUDA check for a lent GPU machine (run from the repo root; writes under $OUT).
#   1. greedy identity: speculative == plain greedy on SmolLM2, bf16, cuda, batch 1 and 4
#   2. generate --baseline on HumanEval prompts (cuda, bf16): tokens/s of both and the ratio
#   3. profile-sps on cuda (bf16) for batch tokens 1..256: our table, SGLang's, PNG
# Usage: OUT=/tmp/out bash benchmarks/gpu_check.sh     (set-up included; ~5 min on an H200)
set -uo pipefail
OUT=${OUT:-$(pwd)/gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
{ ./scripts/setup.sh && .venv/bin/python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; } \
  > "$OUT/setup.log" 2>&1 || { echo "set-up failed; see $OUT/setup.log"; tail -20 "$OUT/setup.log"; exit 1; }
D=.venv/bin/dsparkctl
echo "== greedy identity (cuda, bf16)" | tee "$OUT/summary.txt"
.venv/bin/python - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import torch
from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.math.policies import parse_policy
from dsparkctl.math.sampling import SamplingParams
s = open_session(None, None, "cuda", "bf16", log=lambda m: None)
ids = encode_prompts(s.target.tokenizer, load_prompts("mt-bench", limit=8))
g = SamplingParams(0.0)
ref = [plain_generate(s.plain_adapter(), [p], 64, g, s.stop_ids).outputs[0].tokens for p in ids]
eng = SpeculativeEngine(s.adapter, s.draft, parse_policy(f"static:{s.draft.block_size}"), g, s.stop_ids)
one = [eng.generate([p], 64).outputs[0].tokens for p in ids]
four = eng.generate(ids[:4], 64).outputs
print("batch1 identical:", sum(a == b for a, b in zip(one, ref)), "/", len(ids))
print("batch4 identical:", sum(a.tokens == b for a, b in zip(four, ref[:4])), "/ 4",
      "(bf16 batched forwards may flip near-ties; see the CPU fp32 test for the strict check)")
PY
echo "== generate --baseline (cuda, bf16, HumanEval 32 prompts)" | tee -a "$OUT/summary.txt"
$D generate --device cuda --dtype bf16 --dataset humaneval --limit 32 --batch-size 8 --max-new-tokens 128 \
  --baseline --no-text --json > "$OUT/generate_baseline.json" 2> "$OUT/generate_baseline.err"
.venv/bin/python -c "import json;r=json.load(open('$OUT/generate_baseline.json'));print('tau',r['acceptance']['tau'],'spec tok/s',r['tokens_per_s'],'plain tok/s',r['baseline']['tokens_per_s'],'speedup',r['speedup'])" | tee -a "$OUT/summary.txt"
echo "== profile-sps (cuda, bf16)" | tee -a "$OUT/summary.txt"
$D profile-sps --device cuda --dtype bf16 --requests 1,2,4,8,16,32 --tokens-per-request 1,2,4,6,8 \
  --context-len 512 --repeats 10 --out "$OUT/sps_cuda.json" --json > "$OUT/profile.json" 2> "$OUT/profile.err"
cat "$OUT/profile.json" | tee -a "$OUT/summary.txt"
