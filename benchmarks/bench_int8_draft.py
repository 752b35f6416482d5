"""The draft in fp32 against the draft in int8 (models/quant_linear.py), at one request, greedy.

1. Cost: one proposal (`DSparkDraft.propose`: context update, layers, head, Markov loop,
   confidence) of each draft from the same state, alternated, on MT-Bench prompts (chat-wrapped);
   medians, and the paired ratio int8 / fp32.
2. What the drafts bring: live τ of static:5 (every round verifies all five drafts, so the
   acceptance of every position is seen) on each --dataset, 128 new tokens, with each draft; and
   the outputs checked identical to plain decoding (only the draft changes).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/bench_int8_draft.py \
        [--dataset mt-bench --dataset humaneval] [--prompts 16] [--out benchmarks/results/int8_draft.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.policy_choice import load_policy
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.quant_linear import quantize_draft
from dsparkctl.models.target import TargetAdapter

GREEDY = SamplingParams(0.0)


def proposal_ms(sess, drafts: dict, prompts, steps: int) -> dict:
    """Median ms of one proposal per draft, each proposing from the same state in turn."""
    times: dict[str, list[float]] = {k: [] for k in drafts}
    for p in prompts:
        engines = {k: SpeculativeEngine(TargetAdapter(sess.target.model, d.cfg.target_layer_ids), d,  # own caches
                                        load_policy("static:2", d.block_size, None, None), GREEDY,
                                        stop_token_ids=sess.stop_ids) for k, d in drafts.items()}
        lives = {k: e.prefill([p], steps + 8, None) for k, e in engines.items()}
        for _ in range(steps):
            for k, d in drafts.items():
                t0 = time.perf_counter()
                d.propose(lives[k].context, lives[k].anchors, GREEDY, None, need_probs=False)
                times[k].append((time.perf_counter() - t0) * 1e3)
                engines[k].commit(lives[k], *engines[k].plain_step(lives[k], None))
    ratios = [b / a for a, b in zip(times["fp32"], times["int8"])]
    return {"median_ms": {k: round(statistics.median(v), 3) for k, v in times.items()},
            "int8_over_fp32_paired": round(statistics.median(ratios), 3), "proposals": len(ratios)}


def live_tau(sess, drafts: dict, dataset: str, limit: int, tokens: int) -> dict:
    kw = {"field": "prompt"} if dataset.endswith((".jsonl", ".json")) else {}
    prompts = encode_prompts(sess.target.tokenizer, load_prompts(dataset, limit=limit, **kw))
    plain = [plain_generate(sess.plain_adapter(), [p], tokens, GREEDY, stop_token_ids=sess.stop_ids).outputs[0].tokens
             for p in prompts]
    out = {}
    for k, d in drafts.items():
        eng = SpeculativeEngine(sess.adapter, d, load_policy(f"static:{d.block_size}", d.block_size, None, None),
                                GREEDY, stop_token_ids=sess.stop_ids)
        rounds = toks = same = 0
        reached = [0] * d.block_size
        for p, ref in zip(prompts, plain):
            rep = eng.generate([p], tokens)
            rounds, toks = rounds + rep.stats.rounds, toks + rep.stats.tokens
            reached = [a + b for a, b in zip(reached, rep.stats.accepted_at)]
            same += rep.outputs[0].tokens == ref
        out[k] = {"tau": round(toks / rounds, 4), "rounds": rounds, "accepted_at": reached,
                  "identical_to_plain": f"{same}/{len(prompts)}"}
        print(f"{dataset}: {k} τ {toks / rounds:.3f} ({rounds} rounds), identical {same}/{len(prompts)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", action="append", default=None, help="default mt-bench and humaneval (repeatable)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cost-prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="proposals timed per prompt and draft")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "int8_draft.json")
    args = ap.parse_args()
    for flag in ("prompts", "max_new_tokens", "cost_prompts", "steps"):
        if not 1 <= getattr(args, flag) <= 100_000:
            ap.error(f"--{flag.replace('_', '-')} must be between 1 and 100000, got {getattr(args, flag)}")
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out} cannot be created: {why}")
    sess = open_session(None, None, "cpu", "fp32", log=lambda m: None, cpu_kernels="auto", draft_weights="fp32")
    int8 = sess.load_draft(None)[0]
    quantize_draft(int8)
    drafts = {"fp32": sess.draft, "int8": int8}
    with torch.no_grad():
        prompts = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench", limit=args.cost_prompts))
        proposal_ms(sess, drafts, prompts[:1], 3)  # warm-up: fused copies, allocations
        cost = proposal_ms(sess, drafts, prompts, args.steps)
        print(f"proposal: fp32 {cost['median_ms']['fp32']:.2f} ms, int8 {cost['median_ms']['int8']:.2f} ms, "
              f"int8/fp32 paired {cost['int8_over_fp32_paired']:.3f}", flush=True)
        taus = {ds: live_tau(sess, drafts, ds, args.prompts, args.max_new_tokens)
                for ds in (args.dataset or ["mt-bench", "humaneval"])}
    write_json(args.out, {"what": "the shipped draft in fp32 vs int8 at one request, greedy, one process",
                          "threads": torch.get_num_threads(), "cost": cost, "live_tau_static5": taus,
                          **provenance_of(__file__, max_new_tokens=args.max_new_tokens)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
