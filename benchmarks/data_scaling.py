"""Does the draft want more distinct answers or more passes over the same ones? (issue 29)

The data-scaling curve at equal compute: the same recipe and the same number of training blocks
(steps × batch_sequences × anchors_per_sequence), from the same fresh target-initialised draft,
over 1×, 2×, 4×, 8× distinct teacher-forced answers (`data.extra_responses`: the prefix-stable
first N of the recipe's candidates, so every run's answers include the smaller runs'). Each point
is the held-out teacher-forced greedy τ on the recipe's held-out split (the target's own greedy
answers, never trained on). Every run is a real `dsparkctl train` (one process each, `--json`).
The line τ = a + b·log2(answers) is fitted and extrapolated to say how many answers a τ would take.
A draft folder given with --reference (e.g. the shipped one) is evaluated on the same split.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/data_scaling.py recipes/smollm2-135m-dspark-stage5.toml \
        --base 640 --multiples 1 2 4 8 --steps 600 --reference dsparkctl/assets/drafts/smollm2-135m-dspark \
        --out benchmarks/results/data_scaling.json        (a PNG beside it)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.files.atomic import write_json


def train_point(recipe: Path, answers: int, steps: int, log: Path) -> dict:
    cmd = [str(Path(sys.executable).parent / "dsparkctl"), "train", str(recipe), "--json",
           "--set", f"data.extra_responses={answers}", "--set", f"optim.steps={steps}",
           "--set", 'optim.init_from=""', "--set", "eval.every=0", "--set", f"optim.checkpoint_every={steps}"]
    t = time.perf_counter()
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fh, text=True)
    if out.returncode:
        raise SystemExit(f"train for {answers} answers failed (exit {out.returncode}); see {log}")
    doc = json.loads(out.stdout)
    if "recipe" not in doc:  # a run folder left by an earlier call: --resume is not what we want here
        raise SystemExit(f"unexpected train output for {answers} answers: {out.stdout[:200]}")
    ho = doc["heldout_teacher_forced"]
    return {"answers": answers, "train_sequences": doc["train_sequences"], "steps": doc["steps"],
            "blocks": None, "heldout_tau": ho.get("tau"), "heldout": ho, "train_seconds": doc["train_seconds"],
            "wall_seconds": round(time.perf_counter() - t, 1), "run_dir": str(doc["run_dir"])}


def reference_tau(recipe_path: Path, draft: str) -> dict:
    """Held-out τ of an exported draft on the recipe's held-out split (its fc already holds the tap scale)."""
    from dsparkctl.engine.session import open_target
    from dsparkctl.models.draft_io import load_draft
    from dsparkctl.models.target import TargetAdapter
    from dsparkctl.train.data import build_dataset
    from dsparkctl.train.job import default_cache_dir, heldout_stats, split
    from dsparkctl.train.recipe import load_recipe

    import dataclasses

    rec = load_recipe(recipe_path)
    rec = dataclasses.replace(rec, data=dataclasses.replace(rec.data, extra_responses=0, extra_dataset=None))
    sess = open_target(rec.target.model, "cpu", rec.target.dtype, log=lambda m: None)
    seqs = build_dataset(rec, sess.target.model, sess.target.tokenizer, sess.stop_ids, default_cache_dir(),
                         log=lambda m: None, holdout=rec.eval.holdout)
    _, held = split(rec, seqs)
    d = load_draft(draft, TargetAdapter(sess.target.model), dtype=torch.float32, device="cpu")
    return {"draft": draft, **heldout_stats(d, held, rec.eval.temperature).to_json()}


def fit(points: list[dict]) -> dict:
    """Least squares τ = a + b·log2(answers)."""
    xs = [math.log2(p["answers"]) for p in points]
    ys = [p["heldout_tau"] for p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    def answers_for(t: float) -> int | None:  # None: the fit never reaches t (flat or falling), or not below 2^60
        x = (t - a) / b if b > 1e-9 else math.inf
        return round(2 ** x) if x < 60 else None
    need = {str(t): answers_for(t) for t in (1.8, 2.0, 2.5)}
    return {"a": round(a, 4), "b_per_doubling": round(b, 4), "answers_needed_at_this_compute": need}


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = doc["points"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["answers"] for p in pts], [p["heldout_tau"] for p in pts], "o-", label="fresh draft, equal blocks")
    f = doc["fit"]
    xs = [pts[0]["answers"] * 2 ** (i / 4) for i in range(0, 4 * 6)]
    ax.plot(xs, [f["a"] + f["b_per_doubling"] * math.log2(x) for x in xs], ":", color="gray",
            label=f"fit: {f['b_per_doubling']:+.3f} τ per doubling")
    for ref in doc.get("references", []):
        ax.axhline(ref["tau"], color="tab:red", ls="--", lw=1, label=f"reference {Path(ref['draft']).name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distinct teacher-forced answers")
    ax.set_ylabel("held-out τ (greedy, teacher-forced, γ=5)")
    ax.set_title(f"Data scaling at equal compute ({pts[0]['steps']} steps each)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merged(out: Path, recipe: Path, steps: int, point: dict | None) -> dict:
    """The document at `out` with `point` added (points of another recipe or step count are not
    mixed in: refused). Read and written under a lock, so runs for different multiples can go at
    once and each adds its point as it finishes."""
    import fcntl

    from dsparkctl.strict_json import loads

    with open(out.with_suffix(".lock"), "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        doc = loads(out.read_bytes()) if out.is_file() else {"benchmark": "data_scaling", "recipe": str(recipe),
                                                               "steps": steps, "points": [], "references": []}
        if doc["recipe"] != str(recipe) or doc["steps"] != steps:
            raise SystemExit(f"{out} holds points of {doc['recipe']} at {doc['steps']} steps; use another --out")
        if point is not None:
            doc["points"] = sorted([p for p in doc["points"] if p["answers"] != point["answers"]] + [point],
                                   key=lambda p: p["answers"])
        write_json(out, doc)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--base", type=int, default=640, help="answers at 1x (a multiple of data.batch_size keeps the parts shared)")
    ap.add_argument("--multiples", type=int, nargs="*", default=[1, 2, 4, 8],
                    help="runs to do now (each adds its point to --out as it finishes; none: only fit and plot)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--reference", action="append", default=[], help="draft folder to evaluate on the same split")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "data_scaling.json")
    args = ap.parse_args()
    from dsparkctl.train.recipe import load_recipe

    o = load_recipe(args.recipe).optim
    log = args.out.with_suffix(".log")
    for m in args.multiples:
        point = train_point(args.recipe, args.base * m, args.steps, log)
        point["blocks"] = point["steps"] * o.batch_sequences * o.anchors_per_sequence
        merged(args.out, args.recipe, args.steps, point)
        print(json.dumps({k: point[k] for k in ("answers", "heldout_tau", "train_seconds")}), flush=True)
    refs = [reference_tau(args.recipe, r) for r in args.reference]
    doc = merged(args.out, args.recipe, args.steps, None)
    if refs:
        doc["references"] = refs
    if len(doc["points"]) >= 2:
        doc["fit"] = fit(doc["points"])
    doc.update(provenance_of(__file__))
    write_json(args.out, doc)
    if "fit" in doc:
        plot(doc, args.out.with_suffix(".png"))
        print(json.dumps(doc["fit"]))


if __name__ == "__main__":
    main()
