"""Refit the shipped draft's confidence head on greedy labels (head only, frozen features).

Prompts are ShareGPT first turns far past the ones the draft was trained on (training uses the
first ~2,000 conversations; this takes --start on), answered greedily by the embedded target.
Teacher-forced features and labels come from `dsparkctl.train.confidence`; prompts are split
80/20 (by prompt) into fit and held-out parts, and the held-out AUROC / Brier / mean prediction
of the conditional label are reported per slot before and after. With --out the refitted draft
is written there (the rest of the draft bit for bit as it was).

    .venv/bin/python benchmarks/experiments/refit_confidence.py --prompts 192 --out drafts/refit \
        --report benchmarks/results/confidence_refit.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_session
from dsparkctl.evaluation.continuations import cached_continuations
from dsparkctl.files.atomic import cannot_create, write_json
from dsparkctl.math.calibration import auroc, brier
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.draft_io import save_draft
from dsparkctl.train.confidence import confidence_examples, fit_confidence_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import provenance_of  # noqa: E402


def metrics(logits: torch.Tensor, y: torch.Tensor, slot: torch.Tensor, gamma: int) -> list[dict]:
    out = []
    for k in range(1, gamma + 1):
        m = slot == k
        p = torch.sigmoid(logits[m].double())
        out.append({"slot": k, "n": int(m.sum()), "accept_rate": float(y[m].double().mean()),
                    "mean_pred": float(p.mean()), "auroc": auroc(p, y[m]), "brier": brier(p, y[m].double())})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--start", type=int, default=6000, help="first ShareGPT conversation used")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--l2", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--report", type=Path,
                    default=Path(__file__).resolve().parents[1] / "results" / "confidence_refit.json")
    args = ap.parse_args()
    for p in (args.report,):
        if why := cannot_create(p):
            ap.error(f"{p} cannot be created: {why}")
    t0 = time.time()
    sess = open_session(None, args.draft, "cpu", "fp32", log=lambda m: None, cpu_kernels="stock")
    draft, model = sess.draft, sess.target.model
    texts = load_prompts("sharegpt")[args.start: args.start + args.prompts]
    ids = [p for p in encode_prompts(sess.target.tokenizer, texts) if len(p) <= 384]
    conts, _ = cached_continuations(model, ids, SamplingParams(0.0), args.max_new_tokens, sess.stop_ids,
                                    batch_size=16)
    seqs = [p + c for p, c in zip(ids, conts)]
    print(f"{len(seqs)} greedy answers ({sum(map(len, conts))} tokens), {time.time() - t0:.0f} s", flush=True)
    feats, y, slot, seq = confidence_examples(draft, model, seqs, [len(p) for p in ids])
    g = torch.Generator().manual_seed(0)
    held_seqs = torch.randperm(len(seqs), generator=g)[: max(1, len(seqs) // 5)]
    held = torch.isin(seq, held_seqs)
    head = draft.confidence_head.proj
    w0, b0 = head.weight.detach().float().clone(), head.bias.detach().float().clone()
    before = metrics(feats[held] @ w0.T.squeeze(-1) + b0, y[held], slot[held], draft.block_size)
    w, b = fit_confidence_head(feats[~held], y[~held], w0, b0, l2=args.l2)
    after = metrics(feats[held] @ w.T.squeeze(-1) + b, y[held], slot[held], draft.block_size)
    print(f"{int((~held).sum())} fit / {int(held.sum())} held-out examples, {time.time() - t0:.0f} s")
    print("slot  accept  AUROC before → after   Brier before → after   mean pred before → after")
    for a, c in zip(before, after):
        print(f"{a['slot']:4d}  {a['accept_rate']:.3f}   {a['auroc']:.3f} → {c['auroc']:.3f}        "
              f"{a['brier']:.4f} → {c['brier']:.4f}        {a['mean_pred']:.3f} → {c['mean_pred']:.3f}")
    report = {"prompts": len(seqs), "start": args.start, "max_new_tokens": args.max_new_tokens, "l2": args.l2,
              "examples_fit": int((~held).sum()), "examples_heldout": int(held.sum()),
              "label": "greedy: draft argmax at slot k == the target's token (teacher forced)",
              "heldout_before": before, "heldout_after": after, **provenance_of(__file__)}
    if args.out:
        with torch.no_grad():
            head.weight.copy_(w.to(head.weight.dtype))
            head.bias.copy_(b.to(head.bias.dtype))
        save_draft(draft, args.out, overwrite=True)
        report["out"] = str(args.out)
        print(f"wrote {args.out}")
    write_json(args.report, report)
    print(f"wrote {args.report}")


if __name__ == "__main__":
    main()
