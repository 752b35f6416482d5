"""Verify-length policies under load: measured tokens/s beside what `sweep-scheduler` predicts.

For each batch size B (--batch-sizes), `--groups` groups of B prompts (consecutive prompts of the
set, wrapping around) are decoded greedily by every decoder in one process, in a rotating order
per group so drift on a shared machine hits all alike (with --paired-plain, every decoder runs
beside a plain run of its own, before it in one group and after it in the next, and its ratio is
taken against that neighbour):
    plain           plain decoding (the engine's baseline, `plain_generate`)
    static:k        speculative, k drafts verified every round (k = 1..γ)
    threshold:t     stop at the first conditional confidence below t (t chosen beforehand on the
                    calibration traces, --threshold; never on this prompt set)
    dspark          Algorithm 1 on the current survivals; the draft skipped when the last drafted
                    step's survivals say a plain step is faster; with x1's siblings and context
                    lookup as `generate` runs it (--siblings, default auto; --lookup, default on;
                    the replay predicts its chain alone)
    dspark-async    capacity from survivals two steps old, the same skip rule (paper §5.2)
The confidence policies use the calibration (--calibration, default the shipped draft's) and the
SPS table (--sps-table, profiled on this machine minutes before).

Per (B, policy): decode tokens/s (tokens after the first / seconds after prefill: what the
scheduler controls; whole-run tokens/s is reported too), its median over groups, the median of
the per-group ratios to plain (`ratio_to_plain`), the mean verified length ℓ (skipped steps count
as 0), the share of steps that ran the draft, the draft's share of step time, and greedy identity
with plain decoding. The unit of the ratio's statistics is the GROUP (each group is decoded once
per decoder, on its own prompts): `ratio_over_groups` holds the median over groups with a
distribution-free 95% interval (order statistics, `benchmarks/unit_stats.py`) where there are at
least 6 groups, and otherwise the range of the groups, called a range (`kind`); `ratio_interval`
is that interval, null where there is only a range. (Groups wrap around the prompt set, so at 32
requests a third group shares prompts with the first.) `closed_gate_over_groups` pools what
`dspark` and `dspark-async` measured in groups where they drafted no step (the gate closed: the
engine's plain steps against plain decoding), one unit per (batch size, group). The static:γ runs' rounds (full
verification) are pooled over all batch sizes into a replay pool, and `sweep-scheduler`'s
batch replay (`dsparkctl.tuning.sweep.replay_batches`: batches of B requests of --max-new-tokens each,
run to the end, as this benchmark runs them) predicts each cell's decode tokens/s from that pool
and the same SPS table: the error of the prediction is reported beside the measurement, with
the predicted and measured rank of every policy at each batch size.

The results file is rewritten after every batch size (a crash loses at most one), and it keeps
the replay pool, so `--predict-only` recomputes the predictions from it without decoding again,
and every run, so `--recompute` rewrites the ratio statistics from them (`recomputed_from_runs`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_policies.py --sps-table T.json \
        --out benchmarks/results/policies.json --plot benchmarks/results/policies.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py
from unit_stats import interval_or_none, over_units, read_results, rewrite_results  # benchmarks/unit_stats.py

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.formats.calibration import load_survival_prior, load_temperatures
from dsparkctl.formats.sps import load_sps_table
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.strict_json import loads
from dsparkctl.tuning.sweep import replay_batches

QUIET = 0.15  # a run during which another core was busier than this is contaminated (a 1-thread
# run slows by up to 2x when the other core of these 2-core VMs is loaded)
STEAL = 0.05  # nor one during which the hypervisor took more than this of our own core (3-4% is common here)


def cpu_ticks() -> dict[str, tuple[int, int, int]]:
    """Per-CPU (busy, total, stolen) jiffies from /proc/stat; empty where there is none. Stolen
    time is what the hypervisor gave another guest while this CPU had work."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    ticks = {}
    for line in lines:
        f = line.split()
        if f and f[0].startswith("cpu") and f[0] != "cpu":
            v = [int(x) for x in f[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)
            ticks[f[0]] = (sum(v[:8]) - idle, sum(v[:8]), v[7] if len(v) > 7 else 0)
    return ticks


def others_busy(before: dict, after: dict) -> float:
    """The busiest other CPU's share of time between two `cpu_ticks` (ours: this process's affinity)."""
    mine = {f"cpu{c}" for c in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set()
    share = 0.0
    for cpu, (b1, t1, _) in after.items():
        if cpu in mine or cpu not in before:
            continue
        b0, t0, _ = before[cpu]
        if t1 > t0:
            share = max(share, (b1 - b0) / (t1 - t0))
    return share


def stolen(before: dict, after: dict) -> float:
    """The largest share of time stolen from one of this process's CPUs between two `cpu_ticks`:
    a run on a VM whose host ran another guest on our core was slowed by that much, unseen by
    `others_busy`."""
    mine = {f"cpu{c}" for c in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set(after)
    share = 0.0
    for cpu in mine & set(before) & set(after):
        (_, t0, s0), (_, t1, s1) = before[cpu], after[cpu]
        if t1 > t0:
            share = max(share, (s1 - s0) / (t1 - t0))
    return share


def wait_for_quiet(limit_s: float = 300.0) -> None:
    """Wait (at most limit_s) until the other CPUs have been quiet for 3 s."""
    end = time.time() + limit_s
    while time.time() < end:
        before = cpu_ticks()
        time.sleep(3.0)
        if others_busy(before, cpu_ticks()) <= QUIET:
            return


GATED = ("dspark", "dspark-async")  # the policies whose gate can close (every step a plain step)


def cell_ratios(rs: list[dict], plain_runs: list[dict]) -> list[float]:
    """Per group: the decoder's decode tokens/s over its plain neighbour's (--paired-plain) or over
    the group's plain run."""
    return [r["decode_tok_s"] / r.get("paired_plain_decode_tok_s", p["decode_tok_s"]) for r, p in zip(rs, plain_runs)]


def ratio_statistics(ratios: list[float]) -> dict:
    """A cell's ratio figures, the group as the unit."""
    st = over_units(ratios, "group")
    return {"ratio_to_plain": statistics.median(ratios), "ratio_over_groups": st, "ratio_interval": interval_or_none(st)}


def closed_gate(cells: list[dict]) -> dict | None:
    """The gated policies' runs that drafted no step, against plain decoding: one unit per (batch
    size, group), the median of the gated decoders' ratios in that group. None if there are none."""
    plain = {c["batch_size"]: c["runs"] for c in cells if c["policy"] == "plain"}
    units: dict[tuple[int, int], list[float]] = {}
    for c in cells:
        if c["policy"] in GATED:
            for g, (r, ratio) in enumerate(zip(c["runs"], cell_ratios(c["runs"], plain[c["batch_size"]]))):
                if r["drafted_share"] == 0.0:
                    units.setdefault((c["batch_size"], g), []).append(ratio)
    if not units:
        return None
    return {**over_units([statistics.median(v) for v in units.values()], "group"),
            "batch_sizes": sorted({b for b, _ in units}), "decoders": list(GATED),
            "what": "gated decoders' runs with 0% drafted steps (the engine's plain steps) over plain decoding"}


def recompute(path: Path) -> dict:
    """Rewrite a stored result's ratio statistics from its runs, decoding nothing; the run's own
    provenance and predictions stay, and the superseded intervals are kept."""
    doc, read_as = read_results(path)
    plain = {c["batch_size"]: c["runs"] for c in doc["cells"] if c["policy"] == "plain"}
    for c in doc["cells"]:
        c.setdefault("before_recompute", {"ratio_interval": c.get("ratio_interval"),
                                          "what": "95% percentile bootstrap of the median over groups"})
        c.update(ratio_statistics(cell_ratios(c["runs"], plain[c["batch_size"]])))
    doc["closed_gate_over_groups"] = closed_gate(doc["cells"])
    doc["recomputed_from_runs"] = True
    doc["recompute_provenance"] = provenance_of(__file__)["provenance"]
    rewrite_results(path, doc, read_as)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--batch-sizes", default="1,4,8,16,32")
    ap.add_argument("--groups", default="8,4,4,3,3", help="prompt groups per batch size (the unit of the "
                    "ratios' statistics: under 6 give their range, not a 95%% interval)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sps-table", default=None, help="required to decode (not for --predict-only or --recompute)")
    ap.add_argument("--calibration", default=None, help="default: the shipped draft's")
    ap.add_argument("--siblings", default="auto", help="dspark's siblings of x1 (generate's default: auto); the "
                    "other policies run their chains alone")
    ap.add_argument("--lookup", choices=("on", "off"), default="on",
                    help="context lookup for dspark (engine/lookup.py), as generate's --lookup/--no-lookup")
    ap.add_argument("--threshold", type=float, default=0.4)
    ap.add_argument("--static", default=None, help="static:k lengths (default 1..γ)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "policies.json")
    ap.add_argument("--plot", type=Path, default=None, help="default: --out with .png")
    ap.add_argument("--paired-plain", action="store_true",
                    help="run plain decoding beside every decoder (alternately before and after it) and take each "
                    "decoder's ratio against its own neighbour: slower, but a slow spell of a shared host lands on "
                    "both sides of a ratio")
    ap.add_argument("--retries", type=int, default=3,
                    help="times a group is run again when another core was busy during it (> QUIET) or the host "
                    "took our core (> STEAL)")
    ap.add_argument("--predict-only", action="store_true",
                    help="recompute the predictions of an existing --out file from its replay pool")
    ap.add_argument("--recompute", action="store_true",
                    help="rewrite the ratio statistics of an existing --out file from its stored runs (the group as "
                    "the unit) and print its table; decodes nothing, leaves the plot alone")
    args = ap.parse_args()
    if args.recompute:
        if why := cannot_write_file(args.out):
            ap.error(f"--out {args.out} cannot be rewritten: {why}")
        print_table(recompute(args.out))
        print(f"rewrote {args.out} (recomputed_from_runs: true)")
        return
    if args.sps_table is None and not args.predict_only:
        ap.error("--sps-table is required to decode")
    if args.plot is None:  # beside its own --out, never over another run's stored plot
        args.plot = args.out.with_suffix(".png")
    if args.plot.resolve() == args.out.resolve():
        ap.error(f"--plot and --out are both {args.out}: give the plot its own file")
    for p in (args.out, args.plot):
        if why := cannot_write_file(p):
            ap.error(f"{p} cannot be written: {why}")
    if args.predict_only:
        doc = loads(args.out.read_bytes())
        sps = load_sps_table(doc["sps_table"])
        cal = doc["calibration"]
        gamma = doc["replay_pool"]["gamma"]
        predict(doc, sps, load_temperatures(cal, gamma) if cal else None, load_survival_prior(cal, gamma) if cal else None)
        doc["prediction_provenance"] = provenance_of(__file__)["provenance"]  # the decoding keeps its own
        finish(doc, args)
        return
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    if len(groups) != len(sizes):
        ap.error("--groups needs one count per batch size")
    sess = open_session(None, None, "cpu", "fp32", log=lambda m: None, cpu_kernels="auto", draft_weights="auto")
    gamma = sess.draft.block_size
    cal = args.calibration or sess.default_calibration()
    temps = load_temperatures(cal, gamma) if cal else None
    prior = load_survival_prior(cal, gamma) if cal else None
    sps = load_sps_table(args.sps_table)
    statics = [int(k) for k in args.static.split(",")] if args.static else list(range(1, gamma + 1))
    if gamma not in statics:  # its rounds (every position verified) are what the predictions replay
        raise SystemExit(f"--static {args.static} lacks {gamma}, the draft's block size: its rounds are what the "
                         f"predictions replay; add {gamma}")
    specs = [f"static:{k}" for k in statics] + [f"threshold:{args.threshold}", "dspark", "dspark-async"]
    greedy = SamplingParams(0.0)
    engines = {s: SpeculativeEngine(sess.adapter, sess.draft, parse_policy(s, sps=sps, temperatures=temps,
                                                                           prior=prior), greedy,
                                    stop_token_ids=sess.stop_ids, siblings=args.siblings if s == "dspark" else 0,
                                    lookup=s == "dspark" and args.lookup == "on")
               for s in specs}
    plain_adapter = sess.plain_adapter()
    prompts = encode_prompts(sess.target.tokenizer, load_prompts(args.dataset))
    N = args.max_new_tokens
    names = ["plain", *specs]
    for f in [lambda: plain_generate(plain_adapter, [prompts[0][:16]], 4, greedy)] + \
             [lambda e=e: e.generate([prompts[0][:16]], 2 * gamma + 2) for e in engines.values()]:
        f()  # warm-up: allocations, every verify width
    cells, pool_logits, pool_acc = [], [], []
    t_start = time.time()
    discarded = 0

    def run_one(name: str, group: list[list[int]]) -> tuple[dict, list[list[int]], list | None, float, float]:
        """One decoder on `group`: (its figures, its outputs, its trace rows (static:γ only), the largest
        share of time another core was busy, the share stolen from ours)."""
        rows = [] if name == f"static:{gamma}" else None
        before = cpu_ticks()
        t0 = time.perf_counter()
        if name == "plain":
            rep = plain_generate(plain_adapter, group, N, greedy, stop_token_ids=sess.stop_ids)
        else:
            rep = engines[name].generate(group, N, on_round=rows.extend if rows is not None else None)
        wall = time.perf_counter() - t0
        after = cpu_ticks()
        gen = rep.generated
        pre = rep.times_ms.get("prefill", 0.0) / 1000.0
        st = rep.stats if name != "plain" else None
        figures = {
            "tokens": gen, "wall_s": wall, "tok_s": gen / wall,
            "decode_tok_s": (gen - len(group)) / max(wall - pre, 1e-9), "steps": rep.rounds,
            "mean_verify": (st.verified / st.rounds) if st and st.rounds else 0.0,
            "drafted_share": (rep.drafted_steps / rep.rounds) if name != "plain" and rep.rounds else 0.0,
            "draft_share_of_time": rep.times_ms.get("draft", 0.0) / max(rep.times_ms.get("total", 1.0), 1e-9),
            "tau": ((rep.streams.speculative_tokens + rep.streams.plain_rows)  # tokens per row-step, every proposer
                    / max(rep.streams.speculative_rounds + rep.streams.plain_rows, 1)) if st else 1.0,
            "draft_tau": st.tau if st else None}
        return figures, [o.tokens for o in rep.outputs], rows, others_busy(before, after), stolen(before, after)

    def run_group(group: list[list[int]], order: list[str], flip: bool) -> tuple[dict[str, dict], list, float, float]:
        """Every decoder once on `group` (with --paired-plain, each beside a plain run of its own,
        before it or after it as `flip` says): (per-decoder figures, static:γ trace rows, the largest
        share of time another core was busy during one run, the largest share stolen from ours)."""
        fresh, outs, busy, steal, pool_rows = {}, {}, 0.0, 0.0, []
        plains: list[dict] = []
        if args.paired_plain:
            order = [x for n in order if n != "plain" for x in (("plain", n) if flip else (n, "plain"))]
        for name in order:
            figures, outs[name], rows, b, st = run_one(name, group)
            busy, steal = max(busy, b), max(steal, st)
            if name == "plain":
                plains.append(figures)
            else:
                fresh[name] = figures
            if rows is not None:
                pool_rows = rows
        if args.paired_plain:  # the plain run beside each decoder's is its baseline
            for k, name in enumerate(x for x in order if x != "plain"):
                fresh[name]["paired_plain_decode_tok_s"] = plains[k]["decode_tok_s"]
            fresh["plain"] = {**plains[0], "decode_tok_s": statistics.median(p["decode_tok_s"] for p in plains),
                              "paired_runs": [p["decode_tok_s"] for p in plains]}
        else:
            fresh["plain"] = plains[0]
        for name in specs:
            fresh[name]["identical"] = outs[name] == outs["plain"]
        return fresh, pool_rows, busy, steal

    for B, G in zip(sizes, groups):
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for g in range(G):
            group = [prompts[(g * B + i) % len(prompts)] for i in range(B)]
            order = names[g % len(names):] + names[: g % len(names)]
            for attempt in range(args.retries + 1):  # a group that overlapped load elsewhere is run again
                wait_for_quiet()
                fresh, pool_rows, busy, steal = run_group(group, order, flip=g % 2 == 1)
                if busy <= QUIET and steal <= STEAL:
                    break
                discarded += attempt < args.retries
                why = f"another core was {100 * busy:.0f}% busy" if busy > QUIET else \
                    f"the host took {100 * steal:.0f}% of our core"
                print(f"B={B} group {g}: {why} during a run"
                      + ("; running the group again" if attempt < args.retries else "; kept (no retries left)"),
                      flush=True)
            for name in names:
                runs[name].append({**fresh[name], "others_busy": busy, "stolen": steal})
            for r in pool_rows:
                if r.verify_length == gamma and not r.budget_capped:
                    pool_logits.append(r.confidence_logits)
                    pool_acc.append(r.accepted)
            print(f"B={B} group {g}: " + "  ".join(f"{n} {runs[n][-1]['decode_tok_s']:.1f}" for n in names)
                  + f"  ({time.time() - t_start:.0f} s)", flush=True)
        for name in names:
            rs = runs[name]
            cells.append({"batch_size": B, "policy": name, "groups": len(rs),
                          "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                          "tok_s": statistics.median(r["tok_s"] for r in rs),
                          **ratio_statistics(cell_ratios(rs, runs["plain"])),
                          "mean_verify": statistics.mean(r["mean_verify"] for r in rs),
                          "drafted_share": statistics.mean(r["drafted_share"] for r in rs),
                          "draft_share_of_time": statistics.mean(r["draft_share_of_time"] for r in rs),
                          "tau": statistics.mean(r["tau"] for r in rs),
                          "identical": all(r.get("identical", True) for r in rs), "runs": rs})
        doc = {"dataset": args.dataset, "max_new_tokens": N, "sps_table": str(args.sps_table),
               "verify_layout": "padded" if sps.padded else "ragged", "calibration": str(cal) if cal else None, "siblings": args.siblings, "lookup": args.lookup,
               "temperatures": temps, "threads": torch.get_num_threads(), "cpu_kernels": sess.cpu_kernels,
               "batch_sizes_done": sizes[: sizes.index(B) + 1], "cells": cells, "seconds": time.time() - t_start,
               "closed_gate_over_groups": closed_gate(cells),
               "paired_plain": args.paired_plain, "quiet_threshold": QUIET, "steal_threshold": STEAL, "groups_discarded_for_load": discarded,
               "replay_pool": {"gamma": gamma, "confidence_logits": pool_logits, "accepted": pool_acc},
               **provenance_of(__file__)}
        write_json(args.out, doc)  # after every batch size: a crash loses at most one
    predict(doc, sps, temps, prior)
    finish(doc, args)


RANK_GAP = 0.05  # policies measured closer than this are ties: their predicted order is not scored


def predict(doc: dict, sps, temps, prior) -> None:
    """Each cell's prediction from the run's own full-verification rounds and the same SPS table:
    batches of B requests of the run's max_new_tokens, as the benchmark decoded them."""
    pool = doc["replay_pool"]
    pool = {"logits": torch.tensor(pool["confidence_logits"], dtype=torch.float64),
            "accepted": torch.tensor(pool["accepted"]), "gamma": pool["gamma"], "has_confidence": True, "skipped": 0}
    doc["replay_pool_rounds"] = int(pool["accepted"].numel())
    cells = doc["cells"]
    sizes = sorted({c["batch_size"] for c in cells})
    for B in sizes:
        here = [c for c in cells if c["batch_size"] == B]
        specs = ["static:0" if c["policy"] == "plain" else c["policy"] for c in here]
        pred = replay_batches(pool, specs, [B], sps, doc["max_new_tokens"], temps, rounds=20_000, seed=0, prior=prior)
        for c, p in zip(here, pred):
            c["predicted_tok_s"] = p["throughput_tok_s"]
            c["prediction_error"] = p["throughput_tok_s"] / c["decode_tok_s"] - 1.0
            c["predicted_mean_verify"] = p["mean_verify"]
            c["predicted_drafted_share"] = p["drafted_share"]
        meas = sorted(here, key=lambda c: -c["decode_tok_s"])
        predr = sorted(here, key=lambda c: -c["predicted_tok_s"])
        for c in here:
            c["measured_rank"] = meas.index(c) + 1
            c["predicted_rank"] = predr.index(c) + 1
    agree = total = 0  # pairs of policies whose measured speeds differ by more than RANK_GAP: same order predicted?
    for B in sizes:
        here = [c for c in cells if c["batch_size"] == B]
        for i, a in enumerate(here):
            for b in here[i + 1:]:
                if abs(a["decode_tok_s"] / b["decode_tok_s"] - 1.0) > RANK_GAP:
                    total += 1
                    agree += (a["decode_tok_s"] > b["decode_tok_s"]) == (a["predicted_tok_s"] > b["predicted_tok_s"])
    errs = sorted(abs(c["prediction_error"]) for c in cells)
    doc["prediction_summary"] = {
        "cells": len(errs), "within_10pct": sum(e <= 0.10 for e in errs), "median_abs_error": statistics.median(errs),
        "max_abs_error": errs[-1], "rank_gap": RANK_GAP, "pairs_apart": total, "pairs_ordered_right": agree,
        "best_policy_predicted": {str(B): min((c for c in cells if c["batch_size"] == B),
                                              key=lambda c: c["predicted_rank"])["policy"] for B in sizes},
        "best_policy_measured": {str(B): min((c for c in cells if c["batch_size"] == B),
                                             key=lambda c: c["measured_rank"])["policy"] for B in sizes}}


def print_table(doc: dict) -> None:
    """Every cell: its ratio to plain with the 95% interval over groups, or with the range of the
    groups where there are too few for one (marked `range`)."""
    cells = doc["cells"]
    print(f"{'B':>3} {'policy':>16} {'tok/s':>7} {'× plain [95% interval] or (range)':>34} {'pred':>7} {'err':>6} "
          f"{'rank m/p':>8} {'mean ℓ':>6} {'drafted':>7} {'draft%':>6} same")
    for c in cells:
        st = c["ratio_over_groups"]
        bounds = (f"[{st['low']:.3f}, {st['high']:.3f}]" if st["kind"] == "interval"
                  else f"(range {st['low']:.3f}–{st['high']:.3f})")
        pred = (f"{c['predicted_tok_s']:7.1f} {100 * c['prediction_error']:+5.1f}% "
                f"{c['measured_rank']:>3}/{c['predicted_rank']:<3}") if "predicted_tok_s" in c else f"{'':>7} {'':>6} {'':>8}"
        print(f"{c['batch_size']:>3} {c['policy']:>16} {c['decode_tok_s']:7.1f} {c['ratio_to_plain']:6.3f} "
              f"{bounds:>27} {pred} {c['mean_verify']:6.2f} "
              f"{100 * c['drafted_share']:6.0f}% {100 * c['draft_share_of_time']:5.1f}% {c['identical']}")
    groups = sorted({c["groups"] for c in cells})
    print(f"the unit is the group ({', '.join(map(str, groups))} per batch size); fewer than 6 groups give no 95% "
          "interval, only their range")
    if cg := doc.get("closed_gate_over_groups"):
        kind = f"[{cg['low']:.3f}, {cg['high']:.3f}] 95% interval" if cg["kind"] == "interval" else \
            f"range {cg['low']:.3f}–{cg['high']:.3f}"
        print(f"closed gate (dspark, dspark-async with 0% drafted, B = {cg['batch_sizes']}): {cg['median']:.3f}× plain, "
              f"{kind} over {cg['n_units']} groups")
    if s := doc.get("prediction_summary"):
        print(f"prediction: {s['within_10pct']}/{s['cells']} cells within ±10%, median |error| "
              f"{100 * s['median_abs_error']:.1f}%, max {100 * s['max_abs_error']:.1f}%; of {s['pairs_apart']} policy "
              f"pairs measured > {100 * s['rank_gap']:.0f}% apart, {s['pairs_ordered_right']} predicted in the right order")


def finish(doc: dict, args) -> None:
    cells = doc["cells"]
    write_json(args.out, doc)
    print_table(doc)
    sizes = sorted({c["batch_size"] for c in cells})
    names = list(dict.fromkeys(c["policy"] for c in cells))
    plot(cells, sizes, names, args.plot)
    print(f"wrote {args.out}, {args.plot}")


def plot(cells, sizes, names, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsparkctl.files.atomic import atomic_open

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in names:
        xs = [c for c in cells if c["policy"] == name]
        style = "-" if name in ("plain", "dspark", "dspark-async") else ":"
        a1.plot([c["batch_size"] for c in xs], [c["decode_tok_s"] for c in xs], style, marker="o", label=name)
        a2.plot([c["batch_size"] for c in xs], [c["ratio_to_plain"] for c in xs], style, marker="o", label=name)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(sizes, [str(s) for s in sizes])
        a.set_xlabel("batch size (requests decoded together)")
        a.grid(alpha=0.3)
    a1.set_ylabel("decode tokens/s (all requests)")
    a2.set_ylabel("× plain decoding (median of groups)")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
