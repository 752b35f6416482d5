"""The draft's share of a speculative round at batch 1, for one or more drafts, in one process.

For each draft: the median time of its proposal (backbone + head + Markov loop + confidence
head, `DSparkDraft.propose`) and of the target's verify forward over [anchor, γ drafts], at
batch 1 after a real prompt's context; share = draft / (draft + verify). Repeats interleave the
drafts so a shared machine's drift hits all alike.

    .venv/bin/python benchmarks/experiments/bench_draft_share.py --draft A --draft B [--repeats 30] [--out share.json]
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
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.target import TargetAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import provenance_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", action="append", required=True)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sess = open_target(None, "cpu", "fp32", log=lambda m: None)
    prompt = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench", limit=1))[0]
    greedy = SamplingParams(0.0)
    setups = []
    for spec in args.draft:
        d, name, _ = sess.load_draft(spec)
        adapter = TargetAdapter(sess.target.model, d.cfg.target_layer_ids)
        eng = SpeculativeEngine(adapter, d, parse_policy(f"static:{d.block_size}"), greedy)
        live = eng.prefill([prompt], 64, None)
        setups.append((name, d, adapter, eng, live, {"draft": [], "verify": []}))
    with torch.no_grad():
        for i in range(args.repeats + 3):
            for name, d, adapter, eng, live, ms in setups:
                t0 = time.perf_counter()
                prop = d.propose(live.context, live.anchors, greedy, None)
                t1 = time.perf_counter()
                ell = torch.full((1,), d.block_size, dtype=torch.long)
                eng.verify(live, prop.block, ell, None)
                t2 = time.perf_counter()
                adapter.commit(torch.zeros(1, dtype=torch.long))  # exact rollback
                if i >= 3:
                    ms["draft"].append(1000 * (t1 - t0))
                    ms["verify"].append(1000 * (t2 - t1))
    rows = []
    for name, d, *_, ms in setups:
        dr, vr = statistics.median(ms["draft"]), statistics.median(ms["verify"])
        rows.append({"draft": name, "vocab": d.cfg.output_vocab_size, "layers": d.cfg.num_hidden_layers,
                     "draft_ms": dr, "verify_ms": vr, "share": dr / (dr + vr)})
        print(f"{name}: draft {dr:.1f} ms, verify {vr:.1f} ms, draft share of a round {100 * dr / (dr + vr):.1f}% "
              f"(head over {d.cfg.output_vocab_size} ids)")
    if args.out:
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows,
                                        **provenance_of(__file__)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
