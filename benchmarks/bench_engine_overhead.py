"""Where a speculative round's time goes, on the embedded SmolLM2 target (CPU by default).

For batch 1 and batch 8 it runs real generation on MT-Bench prompts and reports, as medians
over rounds:
  * the share of round time spent OUTSIDE the two models' forwards (scheduling, verification
    rule, sampling, cache commit/rollback, bookkeeping) — target ≤ 10 %;
  * the Markov head's serial loop as a share of round time (and of draft time).
Each round is timed with device synchronisation around: draft backbone + LM head, Markov loop,
schedule, target forward, and everything else. Writes benchmarks/results/engine_overhead.json.

    .venv/bin/python benchmarks/bench_engine_overhead.py [--draft PATH] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.clock import sync
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.math import draft_sampling
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models import draft_inference as draft_mod


class Spans:
    """Patches the draft's pieces to time them; the engine's own clock gives draft/verify."""

    def __init__(self, device):
        self.device = device
        self.markov: list[float] = []

    def install(self):
        orig = draft_sampling.sample_block

        def timed(*a, **k):
            sync(self.device)
            t0 = time.perf_counter()
            r = orig(*a, **k)
            sync(self.device)
            self.markov.append((time.perf_counter() - t0) * 1000)
            return r

        draft_mod.sample_block = timed  # DSparkDraft.propose looks the name up in its module


def run(batch: int, args, sess) -> dict:
    spans = Spans(sess.device)
    spans.install()
    prompts = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench", limit=args.prompts))
    pol = parse_policy(f"static:{sess.draft.block_size}")
    eng = SpeculativeEngine(sess.adapter, sess.draft, pol, SamplingParams(args.temperature),
                            stop_token_ids=sess.stop_ids)
    rounds = []

    def on_round(rows):
        rounds.append((rows[0].draft_ms, rows[0].verify_ms))

    gen = torch.Generator().manual_seed(0)
    eng.generate(prompts[:batch], 8, generator=gen)  # warm-up
    spans.markov.clear()
    rounds.clear()
    totals = {}
    wall = 0.0
    for i in range(0, len(prompts), batch):
        t0 = time.perf_counter()
        rep = eng.generate(prompts[i:i + batch], args.max_new_tokens, generator=gen, on_round=on_round)
        wall += time.perf_counter() - t0
        for k, v in rep.times_ms.items():
            totals[k] = totals.get(k, 0.0) + v
    loop = totals["total"] - totals.get("prefill", 0.0)
    outside = totals.get("schedule", 0.0) + totals.get("accept", 0.0)
    markov = sum(spans.markov)
    per_round = [d + v for d, v in rounds]
    return {
        "batch": batch, "rounds": len(rounds), "round_ms_median": statistics.median(per_round),
        "draft_ms_median": statistics.median(d for d, _ in rounds),
        "verify_ms_median": statistics.median(v for _, v in rounds),
        "markov_ms_median": statistics.median(spans.markov),
        "share_outside_forwards": outside / loop,
        "share_markov_of_round": markov / loop,
        "share_markov_of_draft": markov / totals["draft"],
        "loop_ms_total": loop, "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine_overhead.json")
    args = ap.parse_args()
    sess = open_session(None, args.draft, args.device, args.dtype, log=lambda m: None)
    res = {"draft": sess.draft_name, "device": str(sess.device), "dtype": args.dtype,
           "threads": torch.get_num_threads(), "results": [run(b, args, sess) for b in (1, 8)]}
    res.update(provenance_of(__file__))
    for r in res["results"]:
        print(f"batch {r['batch']}: {r['rounds']} rounds, round median {r['round_ms_median']:.1f} ms "
              f"(draft {r['draft_ms_median']:.1f}, verify {r['verify_ms_median']:.1f}, markov "
              f"{r['markov_ms_median']:.2f}); outside forwards {100 * r['share_outside_forwards']:.1f}% "
              f"of round time; Markov loop {100 * r['share_markov_of_round']:.1f}% of round, "
              f"{100 * r['share_markov_of_draft']:.1f}% of draft")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
