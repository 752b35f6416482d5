"""Where one speculative round's time goes, stage by stage, beside each stage's arithmetic floor.

A round of the engine (`SpeculativeEngine.round`: draft, schedule, verify, commit) is run on real
MT-Bench prompts (chat-wrapped), greedy, at each batch size asked, with every stage timed by a
wrapper around the function the engine calls (exclusive time: a stage nested in another is
subtracted from it). "Python between them" is the round's total minus the sum of its stages. At
each of several decoding positions the round is run `--repeats` times and rewound
(`SpeculativeEngine.mark`), then run once more for real so the next position is further on;
medians over all timed rounds (warm-up discarded). Every round verifies `--drafts` drafts per
row (profile-sps's `DraftEvery`: a drafted step at t = drafts + 1 tokens per request).

Floors: each stage's FLOPs (2·rows·in·out per linear) and bytes of distinct weights read, and
the time those would take on this machine, the larger of two measured figures: the linears timed
alone (plain fp32 matmuls of the same shapes, repeated on the same warm weight, the best of
torch's stock kernel and oneDNN's packed one) and the weight bytes at this core's measured read
bandwidth (a sum over 256 MB; a round's weights never stay cached, as the target's forward
streams hundreds of MB between two drafts). Stages without weights (policy, acceptance rule,
cache trim, Python) have floor 0 except the rule's argmax over the target's logits, timed alone.
The draft's context-update floor counts the tokens committed (accepted + 1 per row, the median
round's), not the padded width it runs; the Markov head's W2 counts once (it stays in L2 over
the γ steps). Where every row's context has the same length (always at batch 1) the committed
tokens' K/V are computed inside the layers' fused q/k/v products (`DraftLayer.forward_fused`):
their time then shows under the layers, while their floor stays with the context update.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/profile_round.py \
        [--batch 1 --batch 8] [--positions 32] [--repeats 3] [--drafts 2] [--cpu-kernels auto] \
        [--out benchmarks/results/round_profile.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import provenance_of

import dsparkctl.engine.speculative as spec_mod
import dsparkctl.models.draft_inference as draft_mod
from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.profile import DraftEvery
from dsparkctl.engine.session import open_session
from dsparkctl.engine.speculative import SpeculativeEngine
from dsparkctl.files.atomic import cannot_write_file, write_json
from dsparkctl.math.sampling import SamplingParams

# (stage, label): the rows of the table, in round order
STAGES = [
    ("ctx", "draft context update (fc, norm; append/flush)"),
    ("layers", "draft backbone layers (+ context K/V if fused)"),
    ("backbone_glue", "draft backbone glue (embed, rotary, mask, norm)"),
    ("lm_head", "draft LM head"),
    ("markov", "Markov loop"),
    ("confidence", "confidence head"),
    ("schedule", "policy/schedule"),
    ("target", "verify target forward"),
    ("rule", "accept/verify rule + commit"),
    ("trim", "cache crop/trim (target commit)"),
]


class StageTimer:
    """Exclusive wall time per stage for one round: a stage's time excludes the stages it calls."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open stage: [child ms]

    def wrap(self, owner, attr: str, stage: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:
            return

        def timed(*a, **kw):
            self._stack.append([0.0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = (time.perf_counter() - t0) * 1000.0
                child = self._stack.pop()[0]
                self.ms[stage] += dt - child
                if self._stack:
                    self._stack[-1][0] += dt
        setattr(owner, attr, timed)


def instrument(eng: SpeculativeEngine, timer: StageTimer) -> None:
    drf, tgt = eng.draft, eng.target
    timer.wrap(drf, "append_context", "ctx")
    timer.wrap(drf, "flush_context", "ctx")
    timer.wrap(drf, "context_rows", "ctx")
    timer.wrap(drf, "backbone", "backbone_glue")
    for layer in drf.layers:
        timer.wrap(layer, "forward", "layers")
        timer.wrap(layer, "forward_cached", "layers")
        timer.wrap(layer, "forward_fused", "layers")  # the committed tokens' K/V ride along here
    timer.wrap(drf.lm_head, "forward", "lm_head")
    timer.wrap(draft_mod, "sample_block", "markov")
    if drf.confidence_head is not None:
        timer.wrap(drf.confidence_head, "forward", "confidence")
    timer.wrap(eng, "schedule", "schedule")
    timer.wrap(tgt, "extend", "target")
    timer.wrap(spec_mod, "verify", "rule")
    timer.wrap(eng, "commit", "rule")
    timer.wrap(tgt, "commit", "trim")


# ---------------------------------------------------------------------------- floors
class Rates:
    """Measured time of one fp32 linear of shape rows × in → out (best of stock and packed)."""

    def __init__(self, reps: int = 30):
        self.reps, self.ms = reps, {}
        self.packed_ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

    def _time(self, fn) -> float:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(ts)

    def linear(self, rows: int, d_in: int, d_out: int) -> float:
        key = (rows, d_in, d_out)
        if key not in self.ms:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(rows, d_in, generator=g)
            w = torch.randn(d_out, d_in, generator=g) * 0.02
            best = self._time(lambda: F.linear(x, w))
            if self.packed_ok and d_out > 1:
                p = torch.ops.mkldnn._reorder_linear_weight(w, 8)
                best = min(best, self._time(lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")))
            self.ms[key] = best
        return self.ms[key]

    def read_gb_s(self) -> float:
        """This core's read bandwidth: a sum over 256 MB (far beyond the caches a draft could stay in)."""
        if "read_gb_s" not in self.ms:
            x = torch.ones(64 * 1024 * 1024)
            self.ms["read_gb_s"] = x.numel() * 4 / self._time(lambda: x.sum()) / 1e6
            del x
        return self.ms["read_gb_s"]

    def argmax(self, rows: int, cols: int) -> float:
        key = ("argmax", rows, cols)
        if key not in self.ms:
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
            self.ms[key] = self._time(lambda: x.argmax(dim=-1))
        return self.ms[key]

    def table(self) -> list[dict]:
        out = []
        for k, ms in self.ms.items():
            if k == "read_gb_s":
                out.append({"op": "read bandwidth (sum over 256 MB)", "gb_s": round(ms, 2)})
            elif k[0] == "argmax":
                out.append({"op": "argmax", "rows": k[1], "cols": k[2], "ms": round(ms, 4)})
            else:
                r, i, o = k
                out.append({"op": "linear", "rows": r, "in": i, "out": o, "ms": round(ms, 4),
                            "gflop_s": round(2 * r * i * o / ms / 1e6, 2),
                            "weight_gb_s": round(4 * i * o / ms / 1e6, 2)})
        return out


def floor_of(rates: Rates, linears: list[tuple[int, int, int, int]], reuse: int = 1) -> dict:
    """linears: (rows, in, out, times) -> {gflop, weight_mb, matmul_ms, bandwidth_ms, floor_ms}; `reuse`:
    each weight is the same one read `reuse` times over (counted once in the bytes)."""
    flop = sum(2 * r * i * o * n for r, i, o, n in linears)
    byts = sum(4 * i * o * n for r, i, o, n in linears) / reuse
    ms = sum(rates.linear(r, i, o) * n for r, i, o, n in linears)
    bw = byts / rates.read_gb_s() / 1e6
    return {"gflop": flop / 1e9, "weight_mb": byts / 1e6, "matmul_ms": ms, "bandwidth_ms": bw, "floor_ms": max(ms, bw)}


def target_linears(model: torch.nn.Module, rows: int) -> list[tuple[int, int, int, int]]:
    shapes: dict[tuple[int, int], int] = defaultdict(int)
    for m in model.modules():
        d_in, d_out = getattr(m, "in_features", None), getattr(m, "out_features", None)
        if isinstance(d_in, int) and isinstance(d_out, int) and not list(m.children()):
            shapes[(d_in, d_out)] += 1
    return [(rows, i, o, n) for (i, o), n in shapes.items()]


def floors(eng: SpeculativeEngine, rates: Rates, B: int, drafts: int, committed: int) -> dict[str, dict]:
    cfg = eng.draft.cfg
    H, g, I = cfg.hidden_size, cfg.block_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    qd = cfg.num_attention_heads * cfg.head_dim
    K, L, taps = cfg.output_vocab_size, cfg.num_hidden_layers, len(cfg.target_layer_ids)
    M, T = B * g, drafts + 1
    f = {
        "ctx": floor_of(rates, [(committed, taps * H, H, 1), (committed, H, kv, 2 * L)]),
        "layers": floor_of(rates, [(M, H, qd, L), (M, H, kv, 2 * L), (M, qd, H, L), (M, H, I, 2 * L),
                                   (M, I, H, L)]),
        "lm_head": floor_of(rates, [(M, H, K, 1)]),
        "markov": floor_of(rates, [(B, cfg.markov_rank, K, g)], reuse=g) if cfg.markov_rank else floor_of(rates, []),
        "confidence": floor_of(rates, [(M, H + (cfg.markov_rank if cfg.confidence_head_with_markov else 0), 1, 1)])
        if cfg.enable_confidence_head else floor_of(rates, []),
        "target": floor_of(rates, target_linears(eng.target.model, B * T)),
    }
    if cfg.markov_rank:
        f["markov"]["floor_ms"] += g * rates.argmax(B, K)
    rule = floor_of(rates, [])
    rule["floor_ms"] = rates.argmax(B * T, eng.target.vocab_size)
    f["rule"] = rule
    return f


# ---------------------------------------------------------------------------- the rounds
def profile_batch(eng: SpeculativeEngine, timer: StageTimer, prompts: list[list[int]], B: int, positions: int,
                  repeats: int, drafts: int, warmup: int = 3) -> dict:
    groups = [prompts[i:i + B] for i in range(0, len(prompts) - B + 1, B)]
    per_group = max(1, math.ceil(positions / len(groups)))
    budget = per_group * (eng.draft.block_size + 1) + 16
    eng.policy = DraftEvery(drafts)
    rounds, committed = [], []
    seen = 0
    for grp in groups:
        live = eng.prefill(grp, budget, None)
        eng.round(live, budget, None, _NoClock())  # steady state: a round's committed tokens wait for the next
        for _ in range(per_group):
            rewind = eng.mark(live)
            for _ in range(repeats):
                timer.ms.clear()
                t0 = time.perf_counter()
                rd = eng.round(live, budget, None, _NoClock())
                total = (time.perf_counter() - t0) * 1000.0
                rewind()
                seen += 1
                if seen > warmup:
                    row = dict(timer.ms)
                    row["total"] = total
                    row["python"] = total - sum(timer.ms.values())
                    rounds.append(row)
                    committed.append(int((rd.accepted + 1).sum()))
            eng.round(live, budget, None, _NoClock())  # advance for real
    med = {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in [s for s, _ in STAGES] + ["python", "total"]}
    return {"batch": B, "rounds_timed": len(rounds), "prompt_groups": len(groups),
            "committed_median": statistics.median(committed), "median_ms": med}


class _NoClock:
    def lap(self, name: str) -> float:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, action="append", default=None, help="default: 1 and 8")
    ap.add_argument("--prompts", type=int, default=8, help="MT-Bench prompts (groups of --batch)")
    ap.add_argument("--positions", type=int, default=32, help="decoding positions timed per batch size")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per position (rewound)")
    ap.add_argument("--drafts", type=int, default=2, help="drafts verified per row (t = drafts + 1)")
    ap.add_argument("--cpu-kernels", choices=("auto", "packed", "stock"), default="auto")
    ap.add_argument("--draft-weights", choices=("auto", "fp32", "int8"), default="auto",
                    help="the draft's linears, as generate's --draft-weights (floors stay fp32's: 4 bytes a weight)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "round_profile.json")
    args = ap.parse_args()
    if why := cannot_write_file(args.out):
        ap.error(f"--out {args.out} cannot be created: {why}")
    batches = args.batch or [1, 8]
    if args.prompts < max(batches):
        ap.error(f"--prompts {args.prompts} is fewer than the largest --batch {max(batches)}")
    torch.set_num_threads(1)
    sess = open_session(None, None, "cpu", "fp32", log=lambda m: None, cpu_kernels=args.cpu_kernels,
                        draft_weights=args.draft_weights)
    prompts = encode_prompts(sess.target.tokenizer, load_prompts("mt-bench", limit=args.prompts))
    eng = SpeculativeEngine(sess.adapter, sess.draft, DraftEvery(args.drafts), SamplingParams(0.0),
                            stop_token_ids=sess.stop_ids)
    timer = StageTimer()
    instrument(eng, timer)  # a wrapper costs about a microsecond per call
    with torch.no_grad():
        results = [profile_batch(eng, timer, prompts, B, args.positions, args.repeats, args.drafts) for B in batches]
    rates = Rates()
    for res in results:
        fl = floors(eng, rates, res["batch"], args.drafts, round(res["committed_median"]))
        res["stages"] = [{"stage": s, "label": lab, "median_ms": round(res["median_ms"][s], 3),
                          **({k: round(v, 4) for k, v in fl[s].items()} if s in fl else
                             {"gflop": 0.0, "weight_mb": 0.0, "floor_ms": 0.0})} for s, lab in STAGES]
        res["stages"].append({"stage": "python", "label": "Python between them", "gflop": 0.0, "weight_mb": 0.0,
                              "median_ms": round(res["median_ms"]["python"], 3), "floor_ms": 0.0})
        res["total_ms"] = round(res["median_ms"]["total"], 3)
        res["floor_total_ms"] = round(sum(s["floor_ms"] for s in res["stages"]), 3)
        res["draft_and_engine_ms"] = round(res["median_ms"]["total"] - res["median_ms"]["target"], 3)
        del res["median_ms"]
    doc = {"what": "per-stage profile of one speculative round (engine.round) beside arithmetic floors",
           "dataset": "mt-bench", "prompts": args.prompts, "greedy": True, "drafts_verified": args.drafts,
           "tokens_per_request": args.drafts + 1, "positions": args.positions, "repeats": args.repeats,
           "draft": sess.draft_name, "cpu_kernels": sess.cpu_kernels, "draft_weights": sess.draft_precision,
           "threads": torch.get_num_threads(),
           "note": "stage medians are taken separately, so they need not add up to the median total",
           "batches": results, "rates": rates.table(), **provenance_of(__file__)}
    for res in results:
        print(f"batch {res['batch']}: round {res['total_ms']:.2f} ms (floor {res['floor_total_ms']:.2f}); "
              f"everything but the target forward {res['draft_and_engine_ms']:.2f} ms; "
              f"{res['rounds_timed']} rounds, {res['committed_median']} tokens committed (median)")
        print(f"  {'stage':<48} {'ms':>8} {'floor ms':>9} {'GFLOP':>8} {'weights MB':>11}")
        for s in res["stages"]:
            print(f"  {s['label']:<48} {s['median_ms']:>8.3f} {s['floor_ms']:>9.3f} {s['gflop']:>8.4f} "
                  f"{s['weight_mb']:>11.2f}")
    print(f"read bandwidth {rates.read_gb_s():.2f} GB/s (one core)")
    write_json(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
