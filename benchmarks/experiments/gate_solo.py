"""The skip gate at one request, variant against variant, on real answers (issue 29).

Greedy decisions of `dspark` depend on the confidences and the acceptances only, never on time,
so each variant's decisions on a prompt are exact and one run suffices. Their cost is priced by
the SPS table the gate itself plans with (drafted steps by verify length, skipped steps at the
plain step's price), against plain decoding priced the same way; the prefill is left out of both.
That isolates what a gate variant decides from this machine's noise; `bench_speedup.py` then
times the chosen one. Variants:

  head            as committed before this experiment: one request needs the same 10% margin
                  on paper (GATE_MARGIN) as several
  solo-margin     no margin at one request (SOLO_MARGIN = 0, the default since: one request
                  has no ragged rows, cache holes or compaction to pay for)
  predicted       no realized correction at all, 10% margin (the gate before the correction)
  static:K        every step verifies K drafts (for reference)

The run recorded in benchmarks/results/gate_solo.json also tried decaying the realized evidence
per step, drafted or not, instead of per drafted step (so that a closed gate's rare probes weigh
more): 1.200× against head's 1.189× (medians), and the same as solo-margin with it; it let an
over-confident gate at 3 requests draft 85% of the steps instead of <30%
(tests/test_realized_gate.py), so it was not kept, and its variants are gone from this script.

  OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/experiments/gate_solo.py \\
      --sps-table benchmarks/results/sps_issue29.json --dataset mt-bench --dataset humaneval \\
      --dataset /tmp/writingbench_en.jsonl --prompts 10 --out benchmarks/results/gate_solo.json
(the WritingBench file is the one benchmarks/experiments/issue29_check.sh writes)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from provenance import provenance_of  # noqa: E402  benchmarks/provenance.py

import dsparkctl.math.policies as policies  # noqa: E402
from dsparkctl.data.prompts import encode_prompts, load_prompts  # noqa: E402
from dsparkctl.engine.policy_choice import load_policy  # noqa: E402
from dsparkctl.engine.session import open_session  # noqa: E402
from dsparkctl.engine.speculative import SpeculativeEngine  # noqa: E402
from dsparkctl.errors import DsparkError, UsageError  # noqa: E402
from dsparkctl.files.atomic import cannot_write_file, write_json  # noqa: E402
from dsparkctl.formats.sps import load_sps_table  # noqa: E402
from dsparkctl.math.policy_spec import parse_policy  # noqa: E402
from dsparkctl.math.realized import Realized  # noqa: E402
from dsparkctl.math.sampling import SamplingParams  # noqa: E402

VARIANTS = ("head", "solo-margin", "predicted")


@contextlib.contextmanager
def variant(name: str):
    """Patch the gate into one variant for the duration of the block."""
    correct, solo = Realized.correct, policies.SOLO_MARGIN
    if name in ("head", "predicted"):
        policies.SOLO_MARGIN = policies.GATE_MARGIN
    if name == "predicted":
        Realized.correct = lambda self, profile: profile.double()
    try:
        yield
    finally:
        Realized.correct, policies.SOLO_MARGIN = correct, solo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", action="append", required=True)
    ap.add_argument("--prompts", type=int, default=12, help="per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sps-table", required=True)
    ap.add_argument("--static", default="2,3", help="static:K references, K comma-separated")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 2:
        ap.error("--prompts must be ≥ 1 and --max-new-tokens ≥ 2")
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out} cannot be created: {why}")
    specs = [*VARIANTS, *(f"static:{k.strip()}" for k in args.static.split(","))]
    try:  # everything a user gave is checked before the target loads
        sps = load_sps_table(args.sps_table)
        if sps.plain_seconds(1) is None:
            raise UsageError(f"{args.sps_table} has no plain-step price, so the gate never skips",
                             "profile one with `dsparkctl profile-sps` (format 2)")
        for spec in specs[len(VARIANTS):]:
            parse_policy(spec)
        texts = {ds: load_prompts(ds, limit=args.prompts) for ds in args.dataset}
    except DsparkError as exc:
        ap.error(exc.one_line())
    sess = open_session(None, None, "cpu", "fp32", log=lambda m: None)
    calibration = sess.default_calibration()
    try:  # static:K past the draft's γ is refused here, before any decoding
        engines = {spec: SpeculativeEngine(sess.adapter, sess.draft,
                                           load_policy("dspark" if spec in VARIANTS else spec, sess.draft.block_size,
                                                       None, calibration, sps=sps),
                                           SamplingParams(0.0), stop_token_ids=sess.stop_ids)
                   for spec in specs}
    except DsparkError as exc:
        ap.error(exc.one_line())
    plain_s = sps.plain_seconds(1)
    rows = []
    for ds, prompts in texts.items():
        for i, p in enumerate(encode_prompts(sess.target.tokenizer, prompts)):
            ref = None
            for spec, engine in engines.items():
                steps: list[tuple[bool, int]] = []  # (drafted, verify length) per engine step
                with variant(spec) if spec in VARIANTS else contextlib.nullcontext():
                    rep = engine.generate([p], args.max_new_tokens,
                                          on_round=lambda rs: steps.append((rs[0].drafted, rs[0].verify_length)))
                toks = rep.outputs[0].tokens
                ref = toks if ref is None else ref
                if toks != ref:
                    raise SystemExit(f"{spec}: greedy output differs from {specs[0]}'s on {ds} prompt {i}")
                if not steps:  # the answer ended with its first token: nothing to decide
                    break
                seconds = sum(float(sps.lengths_seconds(torch.tensor([[ell]]))[0]) if drafted else plain_s
                              for drafted, ell in steps)
                rows.append({"dataset": ds, "prompt": i, "variant": spec, "tokens": len(toks), "steps": len(steps),
                             "drafted_share": sum(d for d, _ in steps) / len(steps),
                             "tau": (len(toks) - 1) / len(steps),
                             "modelled_speedup": (len(toks) - 1) * plain_s / seconds})
            else:
                print(f"{ds} {i}: " + "  ".join(f"{r['variant']} {r['modelled_speedup']:.2f}×/{r['drafted_share']:.0%}"
                                              for r in rows[-len(specs):]), flush=True)
    if not rows:
        raise SystemExit("no prompt's answer went past its first token: nothing to compare")
    summary = {}
    for spec in specs:
        mine = [r for r in rows if r["variant"] == spec]
        summary[spec] = {
            "median_modelled_speedup": statistics.median(r["modelled_speedup"] for r in mine),
            "mean_modelled_speedup": statistics.fmean(r["modelled_speedup"] for r in mine),
            "by_dataset": {ds: statistics.median(r["modelled_speedup"] for r in mine if r["dataset"] == ds)
                           for ds in {r["dataset"] for r in mine}},
            "drafted_share": statistics.fmean(r["drafted_share"] for r in mine)}
        print(f"{spec:12s} median {summary[spec]['median_modelled_speedup']:.3f}×  mean "
              f"{summary[spec]['mean_modelled_speedup']:.3f}×  drafted {summary[spec]['drafted_share']:.0%}  " +
              "  ".join(f"{ds} {v:.3f}×" for ds, v in summary[spec]["by_dataset"].items()))
    write_json(args.out, {"sps_table": args.sps_table, "max_new_tokens": args.max_new_tokens, "summary": summary,
                          "rows": rows, **provenance_of(__file__)})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
