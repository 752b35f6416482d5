"""Sweep wall time: the default policies (8) × 11 concurrency levels × 20k request-rounds per cell.

Run: .venv/bin/python benchmarks/bench_sweep.py
Writes a synthetic full-verification trace (known acceptance model, 20k rounds), a CPU-like
staircase SPS table, then times `sweep_traces` (reading the files included) and draws the frontier.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.files.atomic import write_json
from dsparkctl.formats.sps import save_sps_table
from dsparkctl.formats.trace import write_synthetic_trace
from dsparkctl.math.sps import SPSTable
from dsparkctl.math.synthetic import SyntheticModel
from dsparkctl.plots import frontier_plot
from dsparkctl.tuning.sweep import DEFAULT_CONCURRENCY, DEFAULT_POLICIES, sweep_traces


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=20_000)
    args = ap.parse_args()
    d = Path(args.dir)
    trace, sps_path = d / "sweep_trace.jsonl", d / "sweep_sps.json"
    write_synthetic_trace(trace, SyntheticModel(overconfidence=(1.0,) * 5), 400, 50, seed=1)
    bt = [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    save_sps_table(SPSTable(bt, [1 / (0.020 + 2e-5 * b + (0.008 if b >= 4 else 0)) for b in bt],
                            meta={"device": "synthetic CPU-like staircase: step = 20 ms + 0.02 ms/token, +8 ms from B=4"}),
                   sps_path)
    t0 = time.perf_counter()
    res = sweep_traces([trace], sps_path, DEFAULT_POLICIES, DEFAULT_CONCURRENCY, rounds=args.rounds, seed=0)
    wall = time.perf_counter() - t0
    frontier_plot(res["rows"], d / "sweep_frontier.png")
    print(f"{len(DEFAULT_POLICIES)} policies × {len(DEFAULT_CONCURRENCY)} concurrency levels × "
          f"{args.rounds} request-rounds per cell: {wall:.2f} s")
    res["wall_s"] = wall
    res.update(provenance_of(__file__, **res["provenance"]))  # the sweep's own block (inputs, seed) kept
    write_json(d / "sweep.json", res)
    trace.unlink()  # regenerated on every run; keep the results small


if __name__ == "__main__":
    main()
