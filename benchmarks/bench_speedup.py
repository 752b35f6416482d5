"""Speculative decoding vs plain decoding, as a user at batch 1 sees it (greedy, one process).

For each HumanEval prompt (chat-wrapped, as `generate --dataset humaneval` does) and each repeat,
three decoders run back to back in a rotating order, so slow drifts of a shared machine hit all
three alike:
  * hf     transformers' own `model.generate` (greedy, KV cache) on the same target, as loaded by
           transformers (torch's stock kernels): what a user runs without us
  * plain  dsparkctl's plain decoding (`plain_generate`, the engine's baseline)
  * spec   dsparkctl's speculative engine with the draft and policy given (repeat --policy to
           compare several in the same run: spec:<policy> each; the first is "spec"). Each runs
           with `--siblings` (default auto, as `generate`) and `--lookup` (default on, as `generate`);
           a policy written `SPEC,siblings=N` or `SPEC,lookup=0` (or both) overrides them for that
           decoder, e.g. `--policy dspark --policy dspark,siblings=0 --policy dspark,lookup=0`.
  * plain-stock  (unless --cpu-kernels stock; the default is auto) our plain decoding on the
           stock model, so the gain of the kernel choice and the gain of speculation are reported
           apart: spec/plain is speculation alone (same kernels), plain/plain-stock the kernels alone.
Tokens/s of a run = generated tokens / wall seconds (prefill included for all three); a run's
ratio is taken within one (prompt, repeat) triple. The unit of the statistics is the PROMPT:
greedy repeats of one prompt decode the same tokens, so they measure the machine's noise on one
unit, not new units. Each prompt's ratio is the median of its repeats' ratios, and the figure is
the median over prompts with a distribution-free 95% interval over prompts (order statistics,
`benchmarks/unit_stats.py`); with fewer than 6 prompts there is no such interval, and the range
of the prompts is reported and called a range (`ratio_over_prompts`: median, low, high, kind,
n_units, unit). Kept for older readers: `median_tok_s` and `median_ratio` (medians over all runs)
and `median_ratio_interval95` (now the interval over prompts, null where there is only a range).
Also reported: τ, and the draft's share of a speculative round (draft ms / round ms, medians over
rounds). Greedy outputs of spec and plain must be identical (checked); HF's are compared and
reported.

    .venv/bin/python benchmarks/bench_speedup.py [--draft PATH] [--prompts 8] [--repeats 3]
        [--max-new-tokens 128] [--policy static:5 [--policy dspark --sps-table T]]
        [--out benchmarks/results/speedup.json]
    .venv/bin/python benchmarks/bench_speedup.py --recompute benchmarks/results/speedup_X.json
        # rewrites a stored file's statistics from its `runs`, decoding nothing
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py
from unit_stats import (describe, interval_or_none, over_units, read_results, rewrite_results,  # benchmarks/unit_stats.py
                        unit_medians)

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.policy_choice import load_policy
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.formats.sps import load_sps_table
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.loading import load_target
from dsparkctl.models.target import TargetAdapter


def ratio_pairs(names: list[str]) -> dict[str, tuple[str, str]]:
    """The ratios a run reports, as key -> (numerator, denominator) decoder names."""
    pairs = {f"{k}_over_hf": (k, "hf") for k in names if k not in ("hf", "plain", "spec")}
    pairs.update({f"{k}_over_plain": (k, "plain") for k in names if k.startswith("spec:")})
    if "plain-stock" in names:
        pairs["plain_over_plain_stock"] = ("plain", "plain-stock")
    pairs.update({"spec_over_hf": ("spec", "hf"), "spec_over_plain": ("spec", "plain"), "plain_over_hf": ("plain", "hf")})
    return pairs


def summarize(runs: list[dict]) -> dict:
    """The statistics of a list of runs (one dict per (prompt, repeat), as `main` records them):
    what a new run writes and what --recompute rewrites. The prompt is the unit (module docstring)."""
    names = [k[: -len("_tok_s")] for k in runs[0] if k.endswith("_tok_s")]
    prompts = [r["prompt"] for r in runs]
    n_prompts = len(set(prompts))
    repeats = max(sum(p == q for q in prompts) for p in set(prompts))

    def per_prompt(values: list[float]) -> dict:
        return over_units(unit_medians(values, prompts).values(), "prompt", repeats=repeats)

    pairs = ratio_pairs(names)
    ratios = {key: [r[f"{a}_tok_s"] / r[f"{b}_tok_s"] for r in runs] for key, (a, b) in pairs.items()}
    over_prompts = {key: per_prompt(v) for key, v in ratios.items()}
    legacy = [key for key in pairs if key.startswith("spec:") and key.endswith("_over_plain")] + \
        ["spec_over_plain", "spec_over_hf"]
    return {
        "median_tok_s": {k: statistics.median(r[f"{k}_tok_s"] for r in runs) for k in names},
        "median_ratio": {key: statistics.median(v) for key, v in ratios.items()},
        "unit": "prompt", "n_units": n_prompts, "repeats_per_unit": repeats,
        "ratio_over_prompts": over_prompts,
        "ratio_interval95_over_prompts": {key: interval_or_none(st) for key, st in over_prompts.items()},
        "median_ratio_interval95": {key: interval_or_none(over_prompts[key]) for key in legacy},
        "tau_median": statistics.median(r["tau"] for r in runs),
        "tau_over_prompts": per_prompt([r["tau"] for r in runs]),
    }


def recompute(path: Path) -> dict:
    """Rewrite a stored result's statistics from its `runs`, decoding nothing: the run's own
    provenance stays, the recompute's goes beside it, and the superseded figures are kept."""
    doc, read_as = read_results(path)
    if not doc.get("runs"):
        raise SystemExit(f"{path} has no runs to recompute from")
    fresh = summarize(doc["runs"])
    if "before_recompute" not in doc:  # the first recompute keeps what the run itself reported
        doc["before_recompute"] = {k: doc[k] for k in ("median_ratio_interval95",) if k in doc}
        doc["before_recompute"]["note"] = ("intervals over (prompt, repeat) runs: greedy repeats of a prompt are one "
                                           "unit, so these were too narrow, or a min and max called an interval")
    for key in ("tau_median", "median_tok_s", "median_ratio"):
        fresh.pop(key)  # unchanged by the recompute: the run's own values stay as written
    doc.update(fresh)
    doc["recomputed_from_runs"] = True
    doc["recompute_provenance"] = provenance_of(__file__)["provenance"]
    rewrite_results(path, doc, read_as)
    return doc


def print_ratios(result: dict, spec_policy: str, cpu_kernels: str) -> None:
    """The ratios with their interval over prompts, or their range where there are too few."""
    st = result["ratio_over_prompts"]
    med = result["median_tok_s"]
    print("median tokens/s: " + "  ".join(f"{k} {v:.1f}" for k, v in med.items())
          + f"  (τ median {result['tau_median']:.2f})")
    print(f"spec ({spec_policy}) / plain: {describe(st['spec_over_plain'])}")
    print(f"spec / hf: {describe(st['spec_over_hf'])};  plain / hf: {describe(st['plain_over_hf'])}")
    if "plain_over_plain_stock" in st:
        print(f"kernels alone: plain ({cpu_kernels}) / plain (stock): {describe(st['plain_over_plain_stock'])}")
    for key in st:
        if key.startswith("spec:") and key.endswith("_over_plain"):
            print(f"  {key[5:-len('_over_plain')]} / plain: {describe(st[key])}")
    print(f"(the unit is the prompt: each prompt's repeats are aggregated first; {result['n_units']} prompts × "
          f"{result['repeats_per_unit']} repeats)")


def decoder_options(pol: str, defaults: dict[str, str]) -> tuple[str, dict[str, str]]:
    """`SPEC[,siblings=N][,lookup=0|1]` -> (SPEC, the decoder's options over `defaults`)."""
    opts = dict(defaults)
    parts = pol.split(",")
    while len(parts) > 1 and parts[-1].partition("=")[0] in defaults and "=" in parts[-1]:
        key, _, value = parts.pop().partition("=")
        opts[key] = value
    return ",".join(parts), opts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="draft folder (default: the shipped draft)")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policy", action="append", default=None, help="default static:γ (repeatable)")
    ap.add_argument("--sps-table", default=None, help="SPS table for dspark policies")
    ap.add_argument("--siblings", default="auto", help="siblings of x1 (engine/siblings.py): auto or a count")
    ap.add_argument("--lookup", choices=("on", "off"), default="on",
                    help="context lookup (engine/lookup.py), as generate's --lookup/--no-lookup")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cpu-kernels", choices=("auto", "packed", "stock"), default="auto",
                    help="kernels of our decoders (HF generate always runs the stock model)")
    ap.add_argument("--draft-weights", choices=("auto", "fp32", "int8"), default="auto",
                    help="the draft's linears (models/quant_linear.py), as generate's --draft-weights")
    ap.add_argument("--skip-stock", action="store_true",
                    help="do not run plain decoding on the stock kernels (the kernel choice's own gain)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speedup.json")
    ap.add_argument("--recompute", type=Path, default=None, metavar="FILE",
                    help="rewrite FILE's statistics from its stored runs (the prompt as the unit) and exit; "
                    "decodes nothing, so every other option is ignored")
    args = ap.parse_args()
    if args.recompute is not None:
        if why := cannot_write_file(args.recompute):
            ap.error(f"--recompute {args.recompute} cannot be rewritten: {why}")
        doc = recompute(args.recompute)
        print_ratios(doc, doc.get("policy", "spec"), doc.get("cpu_kernels", "?"))
        print(f"rewrote {args.recompute} (recomputed_from_runs: true)")
        return
    defaults = {"siblings": args.siblings, "lookup": "1" if args.lookup == "on" else "0"}
    for pol in args.policy or ():  # every decoder's options checked before any model loads
        if decoder_options(pol, defaults)[1]["lookup"] not in ("0", "1"):
            ap.error(f"--policy {pol}: lookup must be 0 or 1")
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out} cannot be created: {why}")
    if args.threads:
        torch.set_num_threads(args.threads)
    sess = open_session(None, args.draft, "cpu", "fp32", log=lambda m: None, cpu_kernels=args.cpu_kernels,
                        draft_weights=args.draft_weights)
    tok = sess.target.tokenizer
    model = sess.target.model if sess.cpu_kernels == "stock" else load_target(None, torch.device("cpu"),
                                                                             torch.float32, log=lambda m: None).model
    prompts = encode_prompts(tok, load_prompts(args.dataset, limit=args.prompts))
    policies = args.policy or [f"static:{sess.draft.block_size}"]
    spec_policy = policies[0]
    greedy = SamplingParams(0.0)
    sps = load_sps_table(args.sps_table) if args.sps_table else None
    calibration = sess.default_calibration()  # as generate: the draft's own calibration when it ships one

    def engine(pol: str) -> SpeculativeEngine:
        spec, opts = decoder_options(pol, defaults)
        return SpeculativeEngine(sess.adapter, sess.draft, load_policy(spec, sess.draft.block_size, None, calibration,
                                                                       sps=sps), greedy,
                                 stop_token_ids=sess.stop_ids, siblings=opts["siblings"], lookup=opts["lookup"] == "1")
    engines = {pol: engine(pol) for pol in policies}
    plain_adapter = sess.plain_adapter()
    N = args.max_new_tokens

    def hf(p):
        ids = torch.tensor([p])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                 do_sample=False, eos_token_id=sess.stop_ids, pad_token_id=sess.stop_ids[0])
        dt = time.perf_counter() - t0
        return out[0, len(p):].tolist(), dt, None

    def plain(p):
        t0 = time.perf_counter()
        rep = plain_generate(plain_adapter, [p], N, greedy, stop_token_ids=sess.stop_ids)
        return rep.outputs[0].tokens, time.perf_counter() - t0, None

    rounds: dict[str, list[tuple[float, float]]] = {pol: [] for pol in policies}

    def spec_with(pol):
        def spec(p):
            t0 = time.perf_counter()
            rep = engines[pol].generate([p], N, on_round=lambda rows: rounds[pol].append((rows[0].draft_ms,
                                                                                           rows[0].verify_ms)))
            dt = time.perf_counter() - t0
            return rep.outputs[0].tokens, dt, rep
        return spec

    decoders = {"hf": hf, "plain": plain, "spec": spec_with(spec_policy)}
    decoders.update({f"spec:{pol}": spec_with(pol) for pol in policies[1:]})
    if model is not sess.target.model and not args.skip_stock:
        stock_adapter = TargetAdapter(model, ())

        def plain_stock(p):
            t0 = time.perf_counter()
            rep = plain_generate(stock_adapter, [p], N, greedy, stop_token_ids=sess.stop_ids)
            return rep.outputs[0].tokens, time.perf_counter() - t0, None
        decoders["plain-stock"] = plain_stock
    names = list(decoders)
    for f in decoders.values():  # warm-up (allocations, kernel choice)
        f(prompts[0][:16])
    for r in rounds.values():
        r.clear()
    runs = []
    identical = hf_identical = stock_identical = 0
    for rep_i in range(args.repeats):
        for i, p in enumerate(prompts):
            k = (i + rep_i) % len(names)
            order = names[k:] + names[:k]
            res = {}
            for name in order:
                res[name] = decoders[name](p)
            toks = {k: v[0] for k, v in res.items()}
            identical += all(toks[k] == toks["plain"] for k in names if k.startswith("spec"))
            hf_identical += toks["hf"] == toks["plain"]
            stock_identical += toks.get("plain-stock") == toks["plain"]
            r = res["spec"][2]
            n = len(toks["plain"])
            runs.append({"prompt": i, "repeat": rep_i, "tokens": n,
                         **{f"{k}_tok_s": len(toks[k]) / res[k][1] for k in names},
                         "tau": r.streams.engine_tau or 1.0, "draft_tau": r.stats.tau,  # every proposer / the draft alone
                         **{f"{k}_tau": res[k][2].streams.engine_tau or 1.0 for k in names if k.startswith("spec:")},
                         **{f"{k}_draft_tau": res[k][2].stats.tau for k in names if k.startswith("spec:")}})
            print(f"prompt {i} repeat {rep_i}: " + "  ".join(f"{k} {len(toks[k]) / res[k][1]:.1f} tok/s"
                                                             for k in names)
                  + f"  engine τ {r.streams.engine_tau or 0:.2f}, the draft's {r.stats.tau or 0:.2f}", flush=True)
    stats = summarize(runs)
    med = stats["median_tok_s"]
    primary = rounds[spec_policy]
    draft_share = statistics.median(d / (d + v) for d, v in primary) if primary else None
    result = {
        "draft": sess.draft_name, "policy": spec_policy, "siblings": args.siblings, "lookup": args.lookup, "calibration": str(calibration) if calibration else None, "dataset": args.dataset, "prompts": len(prompts),
        "repeats": args.repeats, "max_new_tokens": N, "threads": torch.get_num_threads(),
        "cpu_kernels": sess.cpu_kernels, "draft_weights": sess.draft_precision,
        **stats,
        "draft_share_of_round_median": draft_share,
        "round_ms_median": statistics.median(d + v for d, v in primary) if primary else None,
        "draft_ms_median": statistics.median(d for d, _ in primary) if primary else None,
        "verify_ms_median": statistics.median(v for _, v in primary) if primary else None,
        "other_policies": {pol: {"median_tok_s": med[f"spec:{pol}"],
                                 "over_hf": stats["median_ratio"][f"spec:{pol}_over_hf"],
                                 "tau_median": statistics.median(r[f"spec:{pol}_tau"] for r in runs)}
                           for pol in policies[1:]},
        "greedy_identical_plain_stock_plain": (f"{stock_identical}/{len(runs)}" if "plain-stock" in names else None),
        "greedy_identical_spec_plain": f"{identical}/{len(runs)}",
        "greedy_identical_hf_plain": f"{hf_identical}/{len(runs)}",
        "runs": runs, **provenance_of(__file__),
    }
    print_ratios(result, spec_policy, sess.cpu_kernels)
    for pol, o in result["other_policies"].items():
        print(f"  {pol}: {o['median_tok_s']:.1f} tok/s, τ median {o['tau_median']:.2f}")
    if draft_share is not None:
        print(f"draft share of a round: {100 * draft_share:.1f}% (draft {result['draft_ms_median']:.1f} ms, "
              f"verify {result['verify_ms_median']:.1f} ms, medians)")
    print(f"greedy outputs identical: spec=plain {result['greedy_identical_spec_plain']}, "
          f"hf=plain {result['greedy_identical_hf_plain']}"
          + (f", plain-stock=plain {result['greedy_identical_plain_stock_plain']}" if "plain-stock" in names else ""))
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
