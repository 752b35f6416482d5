"""Scheduler decision time (R = 4096, γ = 5) and early-stop optimality vs brute force.

Run: .venv/bin/python benchmarks/bench_scheduler.py [--out benchmarks/results/scheduler.json]
Timing: 10 warm-up calls, then the median of 200 calls of `Policy.choose` on fixed logits
(fresh logits would only add the RNG cost). One CPU thread count as torch reports it.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.files.atomic import write_json
from dsparkctl.math.admission import expected_throughput, survival_from_logits
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sps import SPSTable


def decision_time(spec: str, R: int, gamma: int, sps: SPSTable, reps: int = 200) -> dict:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(R, gamma, generator=gen) * 2 + 1
    pol = parse_policy(spec, sps=sps)
    for _ in range(10):
        pol.choose(logits)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pol.choose(logits)
        ts.append(time.perf_counter() - t0)
    med = statistics.median(ts)
    return {"policy": spec, "R": R, "gamma": gamma, "median_ms": med * 1e3,
            "p90_ms": sorted(ts)[int(0.9 * reps)] * 1e3, "candidates_per_s": R * gamma / med}


def brute(a, sps):
    R, g = a.shape
    return max(float(expected_throughput(a, torch.tensor(e), sps))
               for e in itertools.product(range(g + 1), repeat=R))


def optimality(cases: int = 300) -> dict:
    gen = torch.Generator().manual_seed(1)
    equal_unimodal, gaps = 0, []
    for i in range(cases):
        R, g = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        a = survival_from_logits(torch.randn(R, g, generator=gen, dtype=torch.float64) * 2 + 1.5)
        n = R * (g + 1)
        beta = float(torch.rand(1, generator=gen)) * 0.5
        lin = SPSTable(list(range(1, n + 1)), [1 / (1 + beta * b) for b in range(1, n + 1)])
        got = parse_policy("dspark", sps=lin).choose_batched(a.unsqueeze(0))[0]
        equal_unimodal += abs(float(expected_throughput(a, got, lin)) - brute(a, lin)) <= 1e-12 * brute(a, lin)
        stair = SPSTable(list(range(1, n + 1)), [1 / (1 + 0.5 * (b // 4) + 0.02 * b) for b in range(1, n + 1)])
        best = brute(a, stair)
        early = float(expected_throughput(a, parse_policy("dspark", sps=stair).choose_batched(a.unsqueeze(0))[0], stair))
        gaps.append(1 - early / best)
    return {"cases": cases, "unimodal_equal_to_brute_force": equal_unimodal,
            "staircase_sps": "SPS(B) = 1/(1 + 0.5*floor(B/4) + 0.02*B)",
            "staircase_gap_mean": sum(gaps) / cases, "staircase_gap_max": max(gaps),
            "staircase_cases_below_optimum": sum(g > 1e-12 for g in gaps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/scheduler.json")
    args = ap.parse_args()
    R, gamma = 4096, 5
    n = R * (gamma + 1)
    sps = SPSTable(list(range(1, n + 1)), [1 / (0.02 + 2e-5 * b + (0.008 if b >= 4 else 0)) for b in range(1, n + 1)])
    rows = [decision_time(s, R, gamma, sps) for s in
            ("dspark", "dspark-async", "retrospective", "budget:8192", "threshold:0.5", "survival:0.4", "static:3")]
    for r in rows:
        print(f"{r['policy']:>14}  R={R} γ={gamma}  median {r['median_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms  "
              f"{r['candidates_per_s'] / 1e6:.1f} M candidates/s")
    opt = optimality()
    print(f"dspark == brute force on unimodal Θ: {opt['unimodal_equal_to_brute_force']}/{opt['cases']} cases")
    print(f"staircase SPS ({opt['staircase_sps']}): early-stop gap mean {opt['staircase_gap_mean']:.2%}, "
          f"max {opt['staircase_gap_max']:.2%}, {opt['staircase_cases_below_optimum']}/{opt['cases']} cases below optimum")
    write_json(args.out, {"decision_time": rows, "optimality": opt, "torch_threads": torch.get_num_threads(),
                          "cpu": platform.processor() or platform.machine(),
                          **provenance_of(__file__)})


if __name__ == "__main__":
    main()
