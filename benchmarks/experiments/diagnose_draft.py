"""Diagnose a draft recipe: n-gram baselines, drafts on the same held-out continuations, step profile.

1. Baselines (evaluation/baselines.py): a unigram and a bigram guess fitted on the recipe's
   training continuations, scored teacher-forced and greedy on (a) the recipe's held-out split
   and (b) the target's greedy continuations of each --dataset. Every --draft is scored on the
   same continuations (teacher-forced, greedy, exact: a real target forward), so "is the draft
   better than a bigram?" is answered on identical data.
2. Step profile: where one training step of the recipe goes (data, draft backbone forward,
   vocabulary projections forward, target distribution + loss, backward, optimizer), medians
   over --steps steps, plus the same for the projections of the full 49k vocabulary that the
   previous recipe paid (its target distribution was recomputed from the cached final hidden
   state every step: one more vocabulary-wide projection).

    .venv/bin/python benchmarks/experiments/diagnose_draft.py recipes/smollm2-135m-dspark.toml \\
        --draft dsparkctl/assets/drafts/smollm2-135m-dspark --dataset mt-bench --dataset humaneval \\
        --limit 40 --out benchmarks/results/diagnosis.json
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
from dsparkctl.evaluation.baselines import NGramGuess, baseline_stats
from dsparkctl.evaluation.continuations import cached_continuations
from dsparkctl.evaluation.teacher_forced import evaluate_sequences
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.draft_io import load_draft
from dsparkctl.models.loading import load_target, stop_token_ids
from dsparkctl.train.batches import make_batch
from dsparkctl.train.job import default_cache_dir, prepare
from dsparkctl.train.loss import dspark_loss
from dsparkctl.train.recipe import load_recipe
from dsparkctl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import provenance_of  # noqa: E402


def summary(stats) -> dict:
    c = stats.conditional()
    return {"tau": stats.tau, "tau_interval": stats.tau_interval(), "c1": c[0], "conditional": c,
            "anchors": stats.anchors}


def step_profile(rec, draft, train, scale, steps: int) -> dict:
    tr = Trainer(rec, draft, train, Path("/tmp/dsparkctl-profile-unused"), feature_scale=scale)
    o = rec.optim
    rows = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        pick = torch.randint(len(train), (o.batch_sequences,), generator=tr.gen).tolist()
        b = make_batch([train[i] for i in pick], o.anchors_per_sequence, draft.block_size, tr.gen, tr.to_draft, scale)
        t1 = time.perf_counter()
        hidden = draft.forward_blocks(b.features, b.anchor_ids, b.anchor_pos)
        t2 = time.perf_counter()
        logits, conf = draft.block_logits(hidden, b.prev_tokens)
        t3 = time.perf_counter()
        g, K = logits.shape[-2:]
        k = b.topk_idx.shape[-1]
        parts = dspark_loss(logits.reshape(-1, g, K), b.topk_idx.reshape(-1, g, k), b.topk_p.reshape(-1, g, k),
                            b.target_idx.reshape(-1, g), conf.reshape(-1, g) if conf is not None else None,
                            b.valid.reshape(-1, g), tuple(o.loss_weights))
        t4 = time.perf_counter()
        tr.opt.zero_grad(set_to_none=True)
        parts.total.backward()
        t5 = time.perf_counter()
        tr.opt.step()
        t6 = time.perf_counter()
        rows.append({"data": t1 - t0, "backbone_forward": t2 - t1, "vocab_projections_forward": t3 - t2,
                     "target_distribution_and_loss": t4 - t3, "backward": t5 - t4, "optimizer": t6 - t5,
                     "total": t6 - t0})
    rows = rows[1:]  # the first step allocates
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    slots = o.batch_sequences * o.anchors_per_sequence * draft.block_size
    H = draft.cfg.hidden_size
    # backward share of the head: time one projection forward+backward with the step's shapes
    h = torch.randn(slots, H, requires_grad=True)
    W = draft.lm_head.weight
    t = time.perf_counter()
    for _ in range(3):
        (h @ W.T).sum().backward()
    head_fb = (time.perf_counter() - t) / 3
    full = torch.randn(49152, H) if W.shape[0] != 49152 else W
    t = time.perf_counter()
    for _ in range(3):
        (h @ full.T).sum().backward()
    full_fb = (time.perf_counter() - t) / 3
    t = time.perf_counter()
    with torch.no_grad():
        for _ in range(3):
            torch.softmax(h.detach() @ full.T, -1)
    full_target = (time.perf_counter() - t) / 3
    return {"median_seconds": med, "slots_per_step": slots, "draft_vocab": int(W.shape[0]),
            "head_forward_backward_seconds": head_fb, "full_vocab_head_forward_backward_seconds": full_fb,
            "full_vocab_target_distribution_seconds": full_target, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--draft", action="append", default=[])
    ap.add_argument("--dataset", action="append", default=[])
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="training steps to profile (0: skip)")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "diagnosis.json")
    args = ap.parse_args()
    rec = load_recipe(args.recipe, args.overrides)
    if rec.optim.threads:
        torch.set_num_threads(rec.optim.threads)
    lt = load_target(None, torch.device("cpu"), torch.float32, log=lambda s: None)
    stops = stop_token_ids(lt.tokenizer, lt.model)
    adapter, train, held, draft, scale = prepare(rec, lt.model, lt.tokenizer, stops, args.cache_dir,
                                                 lambda s: None, None)
    g = rec.draft.block_size
    fit = [(s.tokens.tolist(), s.prompt_len) for s in train]
    guessers = {"unigram": NGramGuess(1, adapter.vocab_size).fit(fit),
                "bigram": NGramGuess(2, adapter.vocab_size).fit(fit)}
    drafts = {d: load_draft(d, adapter) for d in args.draft}
    result: dict = {"recipe": str(args.recipe), "overrides": args.overrides, "block_size": g,
                    "train_sequences": len(train), "sets": {}}

    def score(name: str, seqs: list[list[int]], plens: list[int], amax: list[list[int]]) -> None:
        row = {}
        for gname, gu in guessers.items():
            row[gname] = summary(baseline_stats(gu, zip(seqs, plens, amax), g))
        for dname, d in drafts.items():
            row[dname] = summary(evaluate_sequences(d, lt.model, seqs, plens, SamplingParams(0.0)))
        result["sets"][name] = row
        print(f"{name}: " + "  ".join(f"{k} τ {v['tau']:.3f} c1 {v['c1']:.3f}" for k, v in row.items()), flush=True)

    score("heldout", [s.tokens.tolist() for s in held], [s.prompt_len for s in held],
          [s.topk_ids[:, 0].tolist() for s in held])
    for ds in args.dataset:
        prompts = encode_prompts(lt.tokenizer, load_prompts(ds, limit=args.limit))
        conts, _ = cached_continuations(lt.model, prompts, SamplingParams(0.0), args.max_new_tokens, stops)
        seqs = [list(p) + c for p, c in zip(prompts, conts)]
        score(ds, seqs, [len(p) for p in prompts], conts)  # greedy: the argmax is the token itself
    if args.steps:
        result["step_profile"] = step_profile(rec, draft, train, scale, args.steps)
        m = result["step_profile"]["median_seconds"]
        print("step profile (median s): " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))
    result.update(provenance_of(__file__))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
