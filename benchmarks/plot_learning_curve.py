"""Learning curve of training runs: held-out teacher-forced τ against wall clock and blocks seen,
and the per-position training agreement (top-1 of draft vs target, rolling mean).

Reads each run folder's log.jsonl (one line per step: seconds, blocks, top1 per slot) and
evals.jsonl (held-out τ at checkpoints). Runs given in order are chained (a stage that continues
from the previous one's draft starts where it ended on both axes).

    .venv/bin/python benchmarks/plot_learning_curve.py RUN_DIR [RUN_DIR ...] --out curve.png [--json curve.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.files.atomic import write_json


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def chain(runs: list[Path]) -> dict:
    steps, evals = [], []
    t0 = b0 = 0.0
    for i, run in enumerate(runs):
        log = read_jsonl(run / "log.jsonl")
        seconds = {}
        t, b = t0, b0
        for row in log:
            t += row["seconds"]
            b += row.get("blocks", 0)
            seconds[row["step"]] = (t, b)
            steps.append({"stage": i, "step": row["step"], "minutes": t / 60, "blocks": b, "top1": row.get("top1")})
        for e in read_jsonl(run / "evals.jsonl"):
            t_b = seconds.get(e["step"])
            if t_b:
                evals.append({"stage": i, "step": e["step"], "minutes": t_b[0] / 60, "blocks": t_b[1], "tau": e["tau"],
                              "conditional": e["conditional"]})
        t0, b0 = t, b
    return {"runs": [str(r) for r in runs], "steps": steps, "evals": evals}


def plot(curve: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ev = curve["evals"]
    for ax, key, label in ((axes[0], "minutes", "training minutes (2-core CPU)"),
                           (axes[1], "blocks", "blocks seen (log scale: the gain per doubling)")):
        ax.plot([e[key] for e in ev], [e["tau"] for e in ev], "o-", color="tab:blue")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out teacher-forced τ (γ=5, greedy)")
        ax.grid(alpha=0.3)
        if key == "blocks":
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
        stages = sorted({e["stage"] for e in ev})
        for s in stages[1:]:
            first = next(e for e in ev if e["stage"] == s)
            ax.axvline(first[key], color="grey", ls=":", lw=1)
    st = [s for s in curve["steps"] if s["top1"]]
    if st:
        g = len(st[0]["top1"])
        w = max(1, len(st) // 100)
        for k in range(g):
            ys = [s["top1"][k] for s in st]
            smooth = [sum(ys[max(0, i - w): i + 1]) / len(ys[max(0, i - w): i + 1]) for i in range(len(ys))]
            axes[2].plot([s["blocks"] for s in st], smooth, label=f"position {k + 1}")
        axes[2].set_xlabel("blocks seen")
        axes[2].xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:.0f}k"))
        axes[2].set_ylabel(f"training top-1 agreement (rolling mean of {w} steps)")
        axes[2].legend(fontsize=8)
        axes[2].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--title", default="DSpark draft for SmolLM2-135M: learning curve")
    args = ap.parse_args()
    curve = chain(args.runs)
    plot(curve, args.out, args.title)
    if args.json:
        write_json(args.json, {**curve, "steps": curve["steps"][:: max(1, len(curve["steps"]) // 2000)],
                               **provenance_of(__file__)})
    for e in curve["evals"]:
        print(f"stage {e['stage'] + 1} step {e['step']}: {e['minutes']:.0f} min, {e['blocks']:.0f} blocks, τ {e['tau']:.3f}")


if __name__ == "__main__":
    main()
