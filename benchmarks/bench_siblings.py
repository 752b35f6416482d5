"""What siblings of x1 (dsparkctl/engine/siblings.py) can bring, and what they cost, at one request.

1. Coverage, teacher-forced: on the target's own greedy answers to a prompt set (the cached
   continuations `eval-acceptance` uses), how often the target's next token is within the draft's
   top k at each block position (the chain's x_j is its top 1; siblings add ranks 2..k at position
   1), and the draft's mean probability of each rank at position 1 beside the share it is right.
2. Cost: one speculative round at one request with ℓ chain drafts and N siblings, every setting
   run from the same state (`SpeculativeEngine.mark`, rewound) and alternated, on MT-Bench prompts
   (chat-wrapped), greedy; medians, and each against ℓ = 2 without siblings.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/bench_siblings.py \
        [--dataset mt-bench] [--prompts 80] [--out benchmarks/results/siblings.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.profile import DraftEvery
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.evaluation.continuations import cached_continuations
from dsparkctl.evaluation.teacher_forced import anchor_block_logits, target_forward
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.math.sampling import SamplingParams

RANKS = 6
SETTINGS = [(2, 0), (2, 1), (2, 2), (2, 3), (1, 1), (1, 2), (3, 0), (3, 1), (4, 0), (5, 0)]


def coverage(sess, dataset: str, limit: int) -> dict:
    draft, model = sess.draft, sess.target.model
    prompts = encode_prompts(sess.target.tokenizer, load_prompts(dataset, limit=limit))
    conts, _ = cached_continuations(model, prompts, SamplingParams(0.0), 128, sess.stop_ids)
    g = draft.block_size
    hits = torch.zeros(g, RANKS, dtype=torch.float64)
    mean_q = torch.zeros(RANKS, dtype=torch.float64)
    n = 0
    seqs = [list(p) + list(c) for p, c in zip(prompts, conts)]
    for (feats, logits), p, s in zip(target_forward(model, seqs, draft.cfg.target_layer_ids, 8), prompts, seqs):
        anchors = torch.arange(len(p), max(len(p), len(s) - g))
        for idx, lg in anchor_block_logits(draft, feats[None], torch.tensor(s), anchors):
            probs = draft.full_vocab(torch.softmax(lg.float(), -1))  # [n, γ, V]
            top_q, top = probs.topk(RANKS, dim=-1)
            y = logits[idx[:, :g]].argmax(-1)  # the target's greedy next tokens [n, γ]
            hits += (top == y[..., None]).to(torch.float64).cumsum(-1).clamp(max=1).sum(0)
            mean_q += top_q[:, 0].to(torch.float64).sum(0)
            n += int(idx.shape[0])
    first = hits[0] / n
    exact = torch.cat([first[:1], first[1:] - first[:-1]])
    return {"dataset": dataset, "prompts": len(prompts), "anchors": n,
            "within_top_k": [[round(float(v), 4) for v in row / n] for row in hits],
            "position1_rank_taken": [round(float(v), 4) for v in exact],
            "position1_rank_mean_draft_prob": [round(float(v), 4) for v in mean_q / n]}


def round_costs(sess, prompts: list[list[int]], positions: int, repeats: int) -> dict:
    greedy = SamplingParams(0.0)
    engines = {s: SpeculativeEngine(sess.adapter, sess.draft, DraftEvery(s[0]), greedy, siblings=s[1])
               for s in SETTINGS}

    class NoClock:
        def lap(self, name: str) -> float:
            return 0.0
    ms: dict[tuple[int, int], list[float]] = {s: [] for s in SETTINGS}
    first = engines[SETTINGS[0]]
    with torch.no_grad():
        for p in prompts:
            live = first.prefill([p], 1024, None)
            first.round(live, 1024, None, NoClock())  # steady state: a round's tokens wait for the next
            for _ in range(positions):
                rewind = first.mark(live)
                for rep in range(repeats + 1):
                    for s, eng in engines.items():
                        t0 = time.perf_counter()
                        eng.round(live, 1024, None, NoClock())
                        dt = (time.perf_counter() - t0) * 1e3
                        rewind()
                        if rep:
                            ms[s].append(dt)
                first.round(live, 1024, None, NoClock())
    base = statistics.median(ms[SETTINGS[0]])
    return {"prompts": len(prompts), "positions_per_prompt": positions, "repeats": repeats,
            "rounds": [{"chain_drafts": s[0], "siblings": s[1], "tokens": 1 + s[0] + s[1],
                        "median_ms": round(statistics.median(v), 3),
                        "vs_2_drafts": round(statistics.median(v) / base, 4)} for s, v in ms.items()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="mt-bench", help="coverage's prompt set")
    ap.add_argument("--prompts", type=int, default=80, help="coverage's prompts (their continuations are cached)")
    ap.add_argument("--cost-prompts", type=int, default=4, help="MT-Bench prompts the round costs are timed on")
    ap.add_argument("--positions", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "siblings.json")
    args = ap.parse_args()
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out} cannot be created: {why}")
    torch.set_num_threads(1)
    sess = open_session(None, None, "cpu", "fp32", log=lambda m: None, cpu_kernels="auto", draft_weights="auto")
    with torch.no_grad():
        cov = coverage(sess, args.dataset, args.prompts)
    print("within the draft's top k (rows: position 1..γ; columns: k = 1..6):")
    for j, row in enumerate(cov["within_top_k"]):
        print(f"  position {j + 1}: " + " ".join(f"{v:.3f}" for v in row))
    print("position 1, rank 1..6: taken", cov["position1_rank_taken"], "mean draft probability",
          cov["position1_rank_mean_draft_prob"])
    prompts = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench", limit=args.cost_prompts))
    cost = round_costs(sess, prompts, args.positions, args.repeats)
    for r in cost["rounds"]:
        print(f"  ℓ={r['chain_drafts']} N={r['siblings']} ({r['tokens']} tokens): {r['median_ms']:.2f} ms, "
              f"{r['vs_2_drafts']:.3f}× ℓ=2 alone")
    write_json(args.out, {"what": "siblings of x1: teacher-forced coverage and one request's round cost",
                          "draft": sess.draft_name, "cpu_kernels": sess.cpu_kernels, "threads": 1,
                          "coverage": cov, "round_cost": cost, **provenance_of(__file__)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
