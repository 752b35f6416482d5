"""The drafted head's cost per draft step: vLLM's reduced export vs the full-vocabulary copy.

Both exports of one reduced-vocabulary draft (`serve-config --export-vllm A --export-full-vocab B`)
are loaded through our loader and run on the embedded target's context, batch 1 and 8, greedy.
Per draft step (one block of γ tokens for every row) it times, medians over interleaved repeats:
  backbone   the parallel block forward (the same in both: it does not see the vocabulary)
  head       LM head over the draft vocabulary + the serial Markov loop that samples the block
             (`sample_block`): where the exports differ ([γ, H] x [H, K] vs [H, V], W2 K vs V rows)
  step       the whole `DSparkDraft.propose` (backbone + head + confidence head)
This is our engine on CPU, not vLLM's; it shows what the vocabulary size costs, one run.

    .venv/bin/python benchmarks/experiments/bench_export_heads.py --draft DIR_A --draft DIR_B [--repeats 20] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_target
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.math.draft_sampling import sample_block
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.target import TargetAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import provenance_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", action="append", required=True)
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sess = open_target(None, "cpu", "fp32", log=lambda m: None)
    prompt = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench", limit=1))[0]
    greedy = SamplingParams(0.0)
    rows = []
    for batch in args.batch or [1, 8]:
        setups = []
        for spec in args.draft:
            d, name, _ = sess.load_draft(spec)
            adapter = TargetAdapter(sess.target.model, d.cfg.target_layer_ids)
            eng = SpeculativeEngine(adapter, d, parse_policy(f"static:{d.block_size}"), greedy)
            live = eng.prefill([prompt] * batch, 64, None)
            setups.append((spec, d, live, {"backbone": [], "head": [], "step": []}))
        with torch.no_grad():
            for i in range(args.repeats + 3):
                for spec, d, live, ms in setups:
                    t0 = time.perf_counter()
                    h = d.backbone(live.context, live.anchors)  # [R, γ, H]
                    t1 = time.perf_counter()
                    base = d.lm_head(h.to(d.lm_head.weight.dtype)).float()  # [R, γ, K or V]
                    need_h = d.markov_head is not None and d.markov_head.needs_hidden
                    sample_block(base, live.anchors, d.markov_head, h if need_h else None, greedy, None,
                                 vocab_ids=d.draft_vocab_ids)
                    t2 = time.perf_counter()
                    d.propose(live.context, live.anchors, greedy, None)
                    t3 = time.perf_counter()
                    if i >= 3:
                        ms["backbone"].append(1000 * (t1 - t0))
                        ms["head"].append(1000 * (t2 - t1))
                        ms["step"].append(1000 * (t3 - t2))
        for spec, d, live, ms in setups:
            med = {k: statistics.median(v) for k, v in ms.items()}
            rows.append({"draft": spec, "batch": batch, "vocab": d.cfg.output_vocab_size, **med})
            print(f"batch {batch}, head over {d.cfg.output_vocab_size:>6} ids ({Path(spec).name}): "
                  f"head {med['head']:.2f} ms, backbone {med['backbone']:.2f} ms, draft step {med['step']:.2f} ms")
    if args.out:
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows,
                                        **provenance_of(__file__)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
