"""What profile-sps measures, and why it matters to the scheduler (issue 9).

Run: .venv/bin/python benchmarks/experiments/compare_sps_measures.py [--draft DIR] [--limit 16]

1. `dsparkctl profile-sps` twice on the same pair: the whole speculative step (draft + schedule +
   verify + context update; the default, what SGLang's table holds) and the target's forward
   alone. One PNG with both curves.
2. Full-verification traces of the pair (`dsparkctl generate --trace`, static:γ, greedy) on
   MT-Bench prompts.
3. `dsparkctl sweep-scheduler` on those traces once per table; the table of the dspark
   scheduler's choices (mean verify length, tokens/step, predicted throughput) under each.
Everything runs through the CLI, as a user would; results land in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "dsparkctl"]
sys.path.insert(0, str(ROOT / "benchmarks"))  # provenance.py
from provenance import provenance_of  # noqa: E402


def run(*args: str) -> None:
    print("$ dsparkctl " + " ".join(args), flush=True)
    subprocess.run([*CLI, *args], check=True, cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None, help="draft folder (default: the shipped draft)")
    ap.add_argument("--dir", default="benchmarks/results")
    ap.add_argument("--limit", type=int, default=16, help="MT-Bench prompts for the traces")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    d = ROOT / args.dir
    draft = ["--draft", args.draft] if args.draft else []
    tables = {}
    for measure in ("whole-step", "target-forward"):
        out = d / f"sps_{measure}.json"
        extra = ["--tokens-per-request", "1,2,3,4,5,6"] if measure == "target-forward" else []
        run("profile-sps", *draft, "--measure", measure, "--requests", "1,2,4", *extra, "--repeats",
            str(args.repeats), "--out", str(out))
        tables[measure] = json.loads(out.read_text())
    from dsparkctl.models.loading import default_draft_dir

    cfg = json.loads((Path(args.draft or default_draft_dir()) / "config.json").read_text())
    gamma = int(cfg.get("block_size") or cfg["dspark_config"]["block_size"])
    trace = d / "sps_compare_trace.jsonl"
    run("generate", *draft, "--dataset", "mt-bench", "--limit", str(args.limit), "--max-new-tokens",
        str(args.max_new_tokens), "--temperature", "0", "--policy", f"static:{gamma}", "--trace", str(trace),
        "--no-text", "--json")
    sweeps = {}
    for measure in tables:
        out = d / f"sweep_{measure}.json"
        run("sweep-scheduler", "--trace", str(trace), "--sps-table", str(d / f"sps_{measure}.sglang.json"),
            "--policies", f"static:1,static:3,static:{gamma},dspark", "--concurrency", "1,2,4,8,16,64",
            "--rounds", "4000", "--out", str(out))
        sweeps[measure] = json.loads(out.read_text())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsparkctl.plots import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for measure, t in tables.items():
        ax.plot(t["batch_tokens"], [1000 / s for s in t["steps_per_sec"]], marker="o", label=measure)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch tokens (requests × tokens per request)")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"profile-sps on {tables['whole-step'].get('target')}: whole step vs target forward")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, d / "sps_whole_vs_forward.png")
    plt.close(fig)

    lines = ["| concurrency | table | dspark mean ℓ | dspark tokens/step | dspark tok/s | best static tok/s |",
             "|---|---|---|---|---|---|"]
    for c in sorted({r["concurrency"] for r in sweeps["whole-step"]["rows"]}):
        for measure, sw in sweeps.items():
            rows = [r for r in sw["rows"] if r["concurrency"] == c]
            ds = next(r for r in rows if r["policy"] == "dspark")
            best = max((r for r in rows if r["policy"].startswith("static:")), key=lambda r: r["throughput_tok_s"])
            lines.append(f"| {c} | {measure} | {ds['mean_verify']:.2f} | {ds['tokens_per_step']:.3f} | "
                         f"{ds['throughput_tok_s']:.1f} | {best['throughput_tok_s']:.1f} ({best['policy']}) |")
    text = "\n".join(lines)
    prov = json.dumps(provenance_of(__file__)["provenance"])
    (d / "sps_compare.md").write_text(text + f"\n\n<!-- provenance: {prov} -->\n")
    print(text)
    trace.unlink()


if __name__ == "__main__":
    main()
