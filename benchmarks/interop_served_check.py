"""Check that `dsparkctl served` recovers what the engines' own classes counted (issue 27).

Reads the files benchmarks/interop_served.py wrote with vLLM's or SGLang's code (OUTDIR) and
their `expected.json` (the true counts of the rounds fed in), reads the files as `dsparkctl served`
does, and prints one line per check: counts recovered exactly; conditional acceptance exact where
the source identifies it (per-step data, or every draft of full length), and otherwise bounds
that contain the true value; vLLM's documented per-position rate beside the true conditional.
`--break` damages our parser on purpose (an off-by-one in the histogram reading and a renamed
per-position series) to show that the checks fail then. Exit status 1 if any check failed.

Usage: .venv/bin/python benchmarks/interop_served_check.py vllm|sglang OUTDIR [--lengths L] [--break]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(("ok   " if ok else "FAIL ") + name + (f": {detail}" if detail else ""))
    if not ok:
        FAILED.append(name)


def close(a, b, tol: float = 1e-9) -> bool:
    return a is not None and b is not None and abs(a - b) <= tol


def read(paths: list[Path]) -> dict:
    from dsparkctl.app.served import ServedSpec, run_served

    return run_served(ServedSpec(sources=tuple(str(p) for p in paths)))


def compare(label: str, doc: dict, exp: dict, expect_exact: bool) -> None:
    counts_ok = (doc["drafts"] == exp["drafts"] and doc["accepted_tokens"] == exp["accepted_tokens"]
                 and (doc["draft_tokens"] is None or doc["draft_tokens"] == exp["draft_tokens"])
                 and [p["accepted"] for p in doc["per_position"]] == exp["accepted_at"])
    check(f"{label}: counts", counts_ok, f"drafts {doc['drafts']}, draft tokens {doc['draft_tokens']}, accepted "
          f"{doc['accepted_tokens']}, per position {[p['accepted'] for p in doc['per_position']]} (fed: "
          f"{exp['drafts']}, {exp['draft_tokens']}, {exp['accepted_tokens']}, {exp['accepted_at']})")
    check(f"{label}: τ", close(doc["tau"], 1 + exp["accepted_tokens"] / exp["drafts"]), f"{doc['tau']:.4f}")
    for p, truth in zip(doc["per_position"], exp["conditional"]):
        k = p["position"]
        if truth is None:
            continue
        if p["identified"]:
            check(f"{label}: position {k} conditional exact", close(p["conditional"], truth),
                  f"{p['conditional']:.4f} (true {truth:.4f}; vLLM-style share of drafts {p['accepted_share']:.4f})")
        else:
            lo, hi = p["conditional_bounds"]
            check(f"{label}: position {k} bounded, truth inside", (not expect_exact) and lo - 1e-12 <= truth <= hi + 1e-12,
                  f"[{lo:.4f}, {hi:.4f}] ∋ {truth:.4f} (share of drafts {p['accepted_share']:.4f}, not conditional)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=("vllm", "sglang"))
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", choices=("full", "recorded", "mixed"), default="full",
                    help="what interop_served.py was run with")
    ap.add_argument("--break", dest="broken", action="store_true", help="damage our parser on purpose")
    args = ap.parse_args()
    if args.broken:
        import dsparkctl.formats.served_responses as fr
        import dsparkctl.formats.served_scrape as fs

        real = fr._histogram_counts
        fr._histogram_counts = lambda hist, K: (lambda acc, A: ([acc[0]] + [x + 1 for x in acc[1:]], A))(*real(hist, K))
        fs.VLLM_PER_POS = fs.VLLM_PER_POS + "_broken"
    exp = json.loads((args.out / "expected.json").read_text())
    full = exp["all"]["draft_tokens"] == exp["all"]["gamma"] * exp["all"]["drafts"]
    tag = f"{args.engine} {args.lengths}"
    try:
        if args.engine == "vllm":
            compare(f"{tag} scrape", read([args.out / "scrape_end.txt"]), exp["all"], full)
            compare(f"{tag} scrape window", read([args.out / "scrape_mid.txt", args.out / "scrape_end.txt"]),
                    exp["window"], exp["window"]["draft_tokens"] == exp["window"]["gamma"] * exp["window"]["drafts"])
            compare(f"{tag} responses summary", read([args.out / "responses_summary.jsonl"]), exp["all"], full)
            compare(f"{tag} responses detailed", read([args.out / "responses_detailed.jsonl"]), exp["all"], True)
        else:
            compare(f"{tag} meta_info", read([args.out / "responses.jsonl"]), exp["all"], full)
    except Exception as exc:  # a broken parser may raise instead of returning wrong numbers
        check(f"{tag}: read", False, f"{type(exc).__name__}: {exc}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
