"""The benchmarks' statistics take the independent unit as the unit: the prompt in
benchmarks/bench_speedup.py (its greedy repeats aggregated first), the group in
benchmarks/bench_policies.py; an interval only where there are enough units, else a range called a
range (benchmarks/unit_stats.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from unit_stats import coverage, describe, interval_or_none, min_units, over_units, unit_medians  # noqa: E402


def test_coverage_and_the_fewest_units():
    assert coverage(5, 0) == pytest.approx(1 - 2 / 32)  # 0.9375: min and max of 5 do not reach 95%
    assert coverage(6, 0) == pytest.approx(1 - 2 / 64)  # 0.969: 6 do
    assert min_units(0.95) == 6 and min_units(0.99) == 8


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_too_few_units_give_a_range(n):
    st = over_units(range(n), "group")
    assert st["kind"] == "range" and (st["low"], st["high"]) == (0, n - 1)
    assert st["coverage"] < 0.95 and st["n_units"] == n and st["unit"] == "group"
    assert interval_or_none(st) is None
    assert "range" in describe(st) and "interval" in describe(st) and f"{n} group" in describe(st)


def test_enough_units_give_the_order_statistic_interval():
    st = over_units([5, 1, 4, 2, 3, 6, 8, 7], "prompt")  # 8: still min and max (k = 1 covers only 93%)
    assert st["kind"] == "interval" and (st["low"], st["high"]) == (1, 8) and st["median"] == 4.5
    assert st["coverage"] == pytest.approx(1 - 2 / 256)
    st = over_units(range(9), "prompt")  # 9: the second smallest and second largest
    assert (st["low"], st["high"]) == (1, 7) and st["coverage"] == pytest.approx(1 - 2 * 10 / 512)
    st = over_units(range(100), "prompt")
    assert st["coverage"] >= 0.95 and coverage(100, int(st["low"]) + 1) < 0.95  # the narrowest that covers
    assert interval_or_none(st) == [st["low"], st["high"]]
    assert describe(over_units([1.0] * 6, "prompt")) == "1.00× [1.00, 1.00] (95% interval over 6 prompts)"
    with pytest.raises(ValueError):
        over_units([], "prompt")


def test_repeats_are_one_unit():
    meds = unit_medians([1.0, 3.0, 10.0, 10.0, 4.0], ["a", "a", "b", "b", "c"])
    assert meds == {"a": 2.0, "b": 10.0, "c": 4.0}


def speedup_runs(prompts: int, repeats: int) -> list[dict]:
    """Runs as bench_speedup records them: repeat r of prompt p, spec faster by (1 + p/10)."""
    return [{"prompt": p, "repeat": r, "tokens": 128, "hf_tok_s": 20.0, "plain_tok_s": 30.0 + r,
             "spec_tok_s": (30.0 + r) * (1 + p / 10), "tau": 1.5 + p / 10}
            for r in range(repeats) for p in range(prompts)]


def test_bench_speedup_counts_prompts_not_runs(tmp_path):
    import bench_speedup

    s = bench_speedup.summarize(speedup_runs(4, 3))  # 12 runs, 4 prompts: a range, not an interval
    st = s["ratio_over_prompts"]["spec_over_plain"]
    assert (s["unit"], s["n_units"], s["repeats_per_unit"]) == ("prompt", 4, 3)
    assert st["kind"] == "range" and st["n_units"] == 4 and (st["low"], st["high"]) == pytest.approx((1.0, 1.3))
    assert s["median_ratio_interval95"]["spec_over_plain"] is None
    assert s["ratio_interval95_over_prompts"]["spec_over_plain"] is None
    s = bench_speedup.summarize(speedup_runs(8, 2))
    assert s["ratio_over_prompts"]["spec_over_plain"]["kind"] == "interval"
    assert s["median_ratio_interval95"]["spec_over_plain"] == pytest.approx([1.0, 1.7])
    assert s["tau_over_prompts"]["median"] == pytest.approx(1.85)

    path = tmp_path / "speedup.json"
    path.write_text(json.dumps({"median_ratio_interval95": {"spec_over_plain": [0.0, 9.0]}, "runs": speedup_runs(4, 2),
                                "provenance": {"command": ["bench_speedup.py"]}}))
    doc = bench_speedup.recompute(path)
    again = json.loads(path.read_text())
    assert again == json.loads(json.dumps(doc)) and again["recomputed_from_runs"] is True
    assert again["provenance"] == {"command": ["bench_speedup.py"]} and "recompute_provenance" in again
    assert again["before_recompute"]["median_ratio_interval95"] == {"spec_over_plain": [0.0, 9.0]}
    assert again["ratio_over_prompts"]["spec_over_plain"]["kind"] == "range"


def test_bench_policies_counts_groups_and_pools_the_closed_gate():
    import bench_policies

    st = bench_policies.ratio_statistics([0.9, 1.0, 1.1])
    assert st["ratio_interval"] is None and st["ratio_over_groups"]["kind"] == "range"
    assert bench_policies.ratio_statistics([1.0] * 6)["ratio_interval"] == [1.0, 1.0]

    def run(tok, plain, drafted):
        return {"decode_tok_s": tok, "paired_plain_decode_tok_s": plain, "drafted_share": drafted}
    plain = [{"decode_tok_s": 10.0}] * 3
    cells = [{"batch_size": 8, "policy": "plain", "runs": plain},
             {"batch_size": 8, "policy": "dspark", "runs": [run(10, 10, 0.0), run(11, 10, 0.0), run(20, 10, 0.5)]},
             {"batch_size": 8, "policy": "dspark-async", "runs": [run(9, 10, 0.0), run(9, 10, 0.0), run(9, 10, 0.0)]},
             {"batch_size": 8, "policy": "static:2", "runs": [run(5, 10, 1.0)] * 3}]
    cg = bench_policies.closed_gate(cells)
    # groups 0 and 1 pool both gated decoders (median of 1.0 and 0.9, of 1.1 and 0.9); group 2 dspark-async alone
    assert cg["n_units"] == 3 and cg["kind"] == "range" and cg["batch_sizes"] == [8]
    assert (cg["low"], cg["median"], cg["high"]) == pytest.approx((0.9, 0.95, 1.0))
    assert bench_policies.closed_gate(cells[:1] + cells[3:]) is None
