"""Short training probes at equal wall clock: which recipe changes buy quality per CPU-minute.

Every probe trains the base recipe with its overrides for the same number of minutes of
training time (constant learning rate after warm-up, so stopping early is fair), evaluating
the same held-out split (the recipe's first `eval.holdout` sequences, teacher-forced, exact
greedy β from the cached target top-1) every `--every` minutes. Evaluation time is not counted.

    .venv/bin/python benchmarks/experiments/probe_recipes.py recipes/smollm2-135m-dspark.toml --minutes 8 \\
        --probe "current:vocab_size=0,init=random,tap_norm=false" --probe "vocab8k:vocab_size=8192" ...

Writes OUT.json (every curve point), OUT.md (the table) and OUT.png (τ against minutes and
against blocks seen).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dsparkctl.models.loading import load_target, stop_token_ids
from dsparkctl.train.draft_init import vocab_coverage
from dsparkctl.train.job import default_cache_dir, heldout_stats, prepare
from dsparkctl.train.recipe import load_recipe
from dsparkctl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: provenance.py
from provenance import provenance_of  # noqa: E402


def run_probe(name: str, overrides: list[str], args, lt, stops, held: list) -> dict:
    """Train one variant for args.minutes; `held` is the BASE recipe's held-out split (shared)."""
    rec = load_recipe(args.recipe, args.base + overrides + ["min_lr_ratio=1.0", "steps=1000000",
                                                            "checkpoint_every=1000000"])
    torch.set_num_threads(rec.optim.threads or torch.get_num_threads())
    t = time.perf_counter()
    adapter, train, own_held, draft, scale = prepare(rec, lt.model, lt.tokenizer, stops, args.cache_dir,
                                                     lambda s: None, None)
    if own_held[0].tokens.tolist() != held[0].tokens.tolist():  # another data source: its held-out may train,
        held_prompts = {tuple(s.tokens[: s.prompt_len].tolist()) for s in held}  # but no held-out prompt may
        train = [s for s in train + own_held if tuple(s.tokens[: s.prompt_len].tolist()) not in held_prompts]
    setup_s = time.perf_counter() - t
    run_dir = args.out.parent / f".probe-{args.out.stem}-{name}"
    trainer = Trainer(rec, draft, train, run_dir, feature_scale=scale)
    points, elapsed, blocks = [], 0.0, 0
    curve = held[: args.curve_sequences]  # intermediate points on a subset; the final one on all
    st = heldout_stats(draft, curve, 0.0, scale)
    points.append({"minutes": 0.0, "steps": 0, "blocks": 0, "tau": st.tau, "conditional": st.conditional(),
                   "sequences": len(curve)})
    per_step = rec.optim.batch_sequences * rec.optim.anchors_per_sequence
    while True:
        if args.blocks:  # equal work instead of equal wall clock (fair on a shared machine)
            steps = max(1, round(min(args.every_blocks, args.blocks - blocks) / per_step))
            res = trainer.train(stop_after=steps)
        else:
            res = trainer.train(max_seconds=min(args.every * 60, args.minutes * 60 - elapsed))
        elapsed += res.seconds
        blocks += sum(lg.blocks for lg in res.logs)
        final = blocks >= args.blocks - per_step / 2 if args.blocks else elapsed >= args.minutes * 60 - 1e-6
        st = heldout_stats(draft, held if final else curve, 0.0, scale)
        last = res.logs[-1]
        points.append({"minutes": elapsed / 60, "steps": trainer.step, "blocks": blocks, "tau": st.tau,
                       "conditional": st.conditional(), "sequences": len(held if final else curve),
                       "loss": last.loss, "train_top1": last.top1,
                       "s_per_step": res.seconds / max(1, len(res.logs))})
        print(f"{name}: {elapsed / 60:.1f} min, step {trainer.step}, {blocks} blocks, held-out τ {st.tau:.3f}, "
              f"c1 {st.conditional()[0]:.3f}", flush=True)
        if final:
            break
    phases = {k: sum(lg.phases[k] for lg in res.logs) / len(res.logs) for k in res.logs[0].phases}
    return {"name": name, "overrides": overrides, "setup_seconds": setup_s, "points": points,
            "final_tau": points[-1]["tau"], "final_conditional": points[-1]["conditional"],
            "steps": trainer.step, "blocks": blocks, "seconds_per_step": elapsed / max(1, trainer.step),
            "phases_last_chunk": phases, "vocab_coverage": vocab_coverage(held, draft.draft_vocab_ids,
                                                                          adapter.vocab_size),
            "train_sequences": len(train), "heldout_sequences": len(held)}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        xs = [p["minutes"] for p in r["points"]]
        ys = [p["tau"] for p in r["points"]]
        a.plot(xs[:-1], ys[:-1], marker="o", label=r["name"])
        b.plot([p["blocks"] / 1000 for p in r["points"]][:-1], ys[:-1], marker="o", label=r["name"])
        a.plot(xs[-1:], ys[-1:], marker="*", markersize=12, color=a.lines[-1].get_color())
        b.plot([r["points"][-1]["blocks"] / 1000], ys[-1:], marker="*", markersize=12, color=b.lines[-1].get_color())
    a.set_xlabel("training minutes (2-core CPU); ★ = final, on every held-out sequence")
    b.set_xlabel("blocks seen (thousands)")
    for ax in (a, b):
        ax.set_ylabel("held-out teacher-forced τ (γ=5, greedy)")
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle("Recipe probes at equal wall clock")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--probe", action="append", required=True, help="NAME:key=value,key=value")
    ap.add_argument("--base", action="append", default=[], help="override applied to every probe (key=value)")
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--blocks", type=int, default=0, help="train each probe for this many blocks instead of minutes")
    ap.add_argument("--every-blocks", type=int, default=10_000)
    ap.add_argument("--curve-sequences", type=int, default=16, help="held-out sequences for intermediate points")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "probes")
    args = ap.parse_args()
    lt = load_target(None, torch.device("cpu"), torch.float32, log=lambda s: None)
    stops = stop_token_ids(lt.tokenizer, lt.model)
    base = load_recipe(args.recipe, args.base)
    _, _, held, _, _ = prepare(base, lt.model, lt.tokenizer, stops, args.cache_dir, lambda s: None, None)
    results = []
    for spec in args.probe:
        name, _, rest = spec.partition(":")
        overrides = [kv for kv in rest.split(",") if kv]
        results.append(run_probe(name, overrides, args, lt, stops, held))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"recipe": str(args.recipe), "base": args.base,
                                                              "minutes": args.minutes, "heldout_sequences": len(held),
                                                              "probes": results, **provenance_of(__file__)},
                                                             indent=2) + "\n")
    lines = ["| probe | overrides | steps | blocks | s/step | held-out τ | c1 | c5 |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["final_conditional"]
        lines.append(f"| {r['name']} | {', '.join(r['overrides']) or '-'} | {r['steps']} | {r['blocks']} | "
                     f"{r['seconds_per_step']:.2f} | {r['final_tau']:.3f} | {c[0]:.3f} | {c[-1]:.3f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
