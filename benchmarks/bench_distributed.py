"""Wall clock of eval-acceptance on the embedded pair: 1 process × 2 threads vs 2 gloo ranks × 1 thread.

Both runs evaluate the same prompts (MT-Bench, --limit N, live + teacher-forced, greedy) with the
shipped draft, alternating A/B/A/B... so a shared machine's drift hits both; medians and the
ratio are reported, and the merged results are checked to be identical.

    .venv/bin/python benchmarks/bench_distributed.py [--limit 16] [--repeats 2] [--out benchmarks/results/distributed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from provenance import provenance_of  # benchmarks/provenance.py

ROOT = Path(__file__).resolve().parents[1]


def run(ranks: int, args: list[str]) -> tuple[float, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1" if ranks > 1 else "2", "PYTHONPATH": str(ROOT)}
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "dsparkctl", *args]
    else:
        cmd = [sys.executable, "-m", "dsparkctl", *args]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{ranks} rank(s) failed: {res.stderr[-800:]}")
    return wall, json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distributed.json")
    a = ap.parse_args()
    args = ["eval-acceptance", "--dataset", "mt-bench", "--limit", str(a.limit), "--max-new-tokens",
            str(a.max_new_tokens), "--batch-size", "4", "--mode", "both", "--json"]
    walls: dict[int, list[float]] = {1: [], 2: []}
    docs = {}
    for i in range(a.repeats):
        for ranks in ((1, 2) if i % 2 == 0 else (2, 1)):
            w, d = run(ranks, args)
            walls[ranks].append(w)
            docs[ranks] = d
            print(f"repeat {i}: {ranks} rank(s) {w:.1f} s", flush=True)
    one = docs[1]["datasets"]["mt-bench"]["drafts"]
    two = docs[2]["datasets"]["mt-bench"]["drafts"]
    same = all(one[k][m]["tau"] == two[k][m]["tau"] for k in one for m in ("live", "teacher_forced"))
    med = {r: statistics.median(v) for r, v in walls.items()}
    res = {"prompts": a.limit, "max_new_tokens": a.max_new_tokens, "repeats": a.repeats,
           "wall_s": walls, "median_wall_s": med, "speedup_two_ranks": med[1] / med[2], "identical_results": same,
           **provenance_of(__file__)}
    print(f"median wall: 1 process × 2 threads {med[1]:.1f} s, 2 ranks × 1 thread {med[2]:.1f} s "
          f"(ratio {med[1] / med[2]:.2f}×); merged results identical: {same}")
    a.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
