"""Reduced draft vocabulary: coverage of the target's tokens and the cost per training step and
per round, for a few K (issue 8, FR-Spec-style heads).

For each K (0 = the full 49,152-token vocabulary): the K most frequent response tokens of the
stage-1 recipe's training answers are the draft's head; coverage = share of the HELD-OUT
answers' tokens inside it (a token outside can never be drafted). Cost per training step =
median seconds of steps 3..N of a fresh trainer on the same data (same threads); cost per round =
median ms of the draft's proposal at batch 1 after an MT-Bench prompt (the target's verify
forward is the same for every K and is printed once).

    .venv/bin/python benchmarks/experiments/vocab_sizes.py [--k 2048,4096,8192,16384,0] [--steps 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_target
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.train.draft_init import vocab_coverage
from dsparkctl.train.job import default_cache_dir, prepare
from dsparkctl.train.recipe import load_recipe
from dsparkctl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import provenance_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m-dspark.toml"))
    ap.add_argument("--k", default="2048,4096,8192,16384,0")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vocab_sizes.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_recipe(args.recipe)
    sess = open_target(None, "cpu", "fp32", log=lambda m: None)
    lt = sess.target
    prompt = encode_prompts(lt.tokenizer, load_prompts("mt-bench", limit=1))[0]
    greedy = SamplingParams(0.0)
    rows = []
    for k in [int(x) for x in args.k.split(",")]:
        rec = dataclasses.replace(base, draft=dataclasses.replace(base.draft, vocab_size=k),
                                  optim=dataclasses.replace(base.optim, threads=args.threads))
        adapter, train_seqs, held, draft, _ = prepare(rec, lt.model, lt.tokenizer, sess.stop_ids,
                                                      default_cache_dir(), lambda s: None, None)
        coverage = vocab_coverage(held, draft.draft_vocab_ids, adapter.vocab_size)
        logs = []
        with tempfile.TemporaryDirectory() as run_dir:
            Trainer(rec, draft, train_seqs, Path(run_dir)).train(on_step=logs.append, stop_after=args.steps)
        step_s = statistics.median(s.seconds for s in logs[2:])
        draft.eval()
        eng = SpeculativeEngine(adapter, draft, parse_policy(f"static:{draft.block_size}"), greedy)
        live = eng.prefill([prompt], 64, None)
        ms, verify = [], []
        with torch.no_grad():
            for i in range(args.rounds + 3):
                t0 = time.perf_counter()
                prop = draft.propose(live.context, live.anchors, greedy, None)
                t1 = time.perf_counter()
                eng.verify(live, prop.block, torch.full((1,), draft.block_size, dtype=torch.long), None)
                t2 = time.perf_counter()
                adapter.commit(torch.zeros(1, dtype=torch.long))  # exact rollback
                if i >= 3:
                    ms.append(1000 * (t1 - t0))
                    verify.append(1000 * (t2 - t1))
        row = {"k": k or adapter.vocab_size, "coverage_heldout": coverage, "train_step_s": step_s,
               "draft_ms_per_round": statistics.median(ms), "verify_ms_per_round": statistics.median(verify)}
        rows.append(row)
        print(f"K {row['k']:>6}: held-out coverage {100 * coverage:.2f}%  train step {step_s:.3f} s  "
              f"draft {row['draft_ms_per_round']:.1f} ms/round (verify {row['verify_ms_per_round']:.1f} ms)",
              flush=True)
    args.out.write_text(json.dumps({"recipe": args.recipe, "threads": args.threads, "rows": rows,
                                     **provenance_of(__file__)}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
