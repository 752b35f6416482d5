"""What the CPU kernels change: the target's forward over T new tokens, stock vs packed vs auto.

One process holds the embedded target three times: as transformers loads it (stock), with its
linears packed for oneDNN (`--cpu-kernels packed`, models/packed_linear.py), and routed by row count
to whichever of the two this CPU ran faster (`--cpu-kernels auto`, the default; its choice is
read from the cache or timed first), with the shipped draft on each. For every T (1 = a plain
decode step; γ+1 = a static:γ verification) the forwards run interleaved after the same cached
context, so drifts of the machine hit all alike.
Reported: median ms per forward, the cost of T tokens relative to one (what a round's
verification costs in plain steps), and the draft's `propose` per round. Also checked: the
packed logits agree with the stock ones (max abs difference) and give the same argmax.

    .venv/bin/python benchmarks/bench_cpu_kernels.py [--context 256] [--repeats 15]
        [--out benchmarks/results/cpu_kernels.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.engine.session import open_session
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.target import TargetAdapter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", default="1,2,3,4,5,6,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_kernels.json")
    args = ap.parse_args()
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out} cannot be created: {why}")
    if args.threads:
        torch.set_num_threads(args.threads)
    sessions = {k: open_session(None, None, "cpu", "fp32", log=lambda m: None, cpu_kernels=k)
                for k in ("stock", "packed", "auto")}
    KINDS = ("stock", "packed", "auto")
    assert sessions["packed"].cpu_kernels == "packed", "this torch cannot pack (no oneDNN linear)"
    g = torch.Generator().manual_seed(0)
    V = sessions["stock"].target.model.config.vocab_size
    context = torch.randint(0, V, (1, args.context), generator=g)
    Ts = [int(t) for t in args.tokens.split(",")]
    feeds = {T: torch.randint(0, V, (1, T), generator=g) for T in Ts}
    adapters = {k: TargetAdapter(s.target.model, s.draft.cfg.target_layer_ids) for k, s in sessions.items()}
    for a in adapters.values():
        a.prefill([context[0].tolist()])
    ms: dict[str, dict[int, list[float]]] = {k: {T: [] for T in Ts} for k in sessions}
    agree = {"max_abs_logit_diff": 0.0, "argmax_equal": 0, "argmax_total": 0}
    for rep in range(args.repeats + 2):
        for T in Ts:
            outs = {}
            for k in KINDS[rep % 3:] + KINDS[:rep % 3]:
                a = adapters[k]
                t0 = time.perf_counter()
                outs[k] = a.extend(feeds[T], torch.tensor([T])).logits
                dt = time.perf_counter() - t0
                a.commit(torch.tensor([0]))  # roll back: every repeat sees the same context
                if rep >= 2:
                    ms[k][T].append(1e3 * dt)
            d = max((outs[k] - outs["stock"]).abs().max().item() for k in KINDS[1:])
            agree["max_abs_logit_diff"] = max(agree["max_abs_logit_diff"], d)
            agree["argmax_equal"] += int(((outs["packed"].argmax(-1) == outs["stock"].argmax(-1))
                                          & (outs["auto"].argmax(-1) == outs["stock"].argmax(-1))).sum())
            agree["argmax_total"] += T
    # the draft's propose per round, on the same context
    draft_ms = {}
    for k, s in sessions.items():
        a = TargetAdapter(s.target.model, s.draft.cfg.target_layer_ids)
        out = a.prefill([context[0].tolist()])
        state = s.draft.new_state(1, "cpu", torch.float32)
        s.draft.append_context(state, out.features, torch.tensor([args.context]))
        anchors = context[:, -1]
        times = []
        for rep in range(args.repeats + 2):
            t0 = time.perf_counter()
            s.draft.propose(state, anchors, SamplingParams(0.0), None)
            if rep >= 2:
                times.append(1e3 * (time.perf_counter() - t0))
        draft_ms[k] = statistics.median(times)
    med = {k: {T: statistics.median(v) for T, v in d.items()} for k, d in ms.items()}
    result = {
        "context": args.context, "repeats": args.repeats, "threads": torch.get_num_threads(),
        "auto_choice": sessions["auto"].cpu_kernels,
        "forward_ms_median": {k: {str(T): v for T, v in d.items()} for k, d in med.items()},
        "relative_to_one_token": {k: {str(T): d[T] / d[1] for T in Ts} for k, d in med.items()},
        "packed_over_stock_speed": {str(T): med["stock"][T] / med["packed"][T] for T in Ts},
        "auto_over_best_speed": {str(T): min(med["stock"][T], med["packed"][T]) / med["auto"][T] for T in Ts},
        "draft_propose_ms_median": draft_ms, "agreement": agree, **provenance_of(__file__),
    }
    print(f"target forward after {args.context} cached tokens, medians of {args.repeats} (ms; × one-token cost); "
          f"auto = {sessions['auto'].cpu_kernels}:")
    print(f"{'T':>3} " + " ".join(f"{k:>16}" for k in KINDS) + "  packed speed-up")
    for T in Ts:
        print(f"{T:>3} " + " ".join(f"{med[k][T]:>8.1f} ({med[k][T] / med[k][1]:.2f}×)" for k in KINDS)
              + f"  {med['stock'][T] / med['packed'][T]:>8.2f}×")
    print("draft propose per round: " + ", ".join(f"{k} {draft_ms[k]:.1f} ms" for k in KINDS))
    print(f"logits: max |packed or auto - stock| {agree['max_abs_logit_diff']:.2e}; argmax equal "
          f"{agree['argmax_equal']}/{agree['argmax_total']}")
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
