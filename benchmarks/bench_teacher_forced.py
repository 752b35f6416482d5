"""Teacher-forced vs live acceptance evaluation: wall time per evaluated position, same run.

Live: real speculative rollouts with static:γ; an evaluated position is a draft whose
accept/reject outcome was observed (Σ reached). Teacher-forced: the analytic β over every
full-block anchor of the same continuations (the live outputs, which are distributed exactly
as the target's); an evaluated position is an (anchor, slot) pair. Teacher-forced time includes
its full-sequence target forward. Also reported: the time plain target decoding would take to
produce the continuations when no live run exists (so TF's cost from scratch is visible).

    .venv/bin/python benchmarks/bench_teacher_forced.py [--draft PATH] [--dataset humaneval] [--limit 16]
Writes benchmarks/results/teacher_forced_speed.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.evaluation.acceptance import DraftUnderTest, evaluate_dataset
from dsparkctl.evaluation.live import target_continuations
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.draft_io import load_draft
from dsparkctl.models.loading import default_draft_dir, load_target, stop_token_ids
from dsparkctl.models.target import TargetAdapter
from dsparkctl.provenance import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "teacher_forced_speed.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device("cpu")
    lt = load_target(None, dev, torch.float32, log=lambda s: None)
    src = a.draft or str(default_draft_dir())
    draft = load_draft(src, TargetAdapter(lt.model), dtype=torch.float32, device=dev)
    prompts = encode_prompts(lt.tokenizer, load_prompts(a.dataset, limit=a.limit))
    stops = stop_token_ids(lt.tokenizer, lt.model)
    params = SamplingParams(a.temperature)
    res = evaluate_dataset(lt.model, [DraftUnderTest("draft", draft, src)], prompts, mode="both", params=params,
                           max_new_tokens=a.max_new_tokens, stop_ids=stops, seed=0, batch_size=a.batch_size)
    r = res["drafts"]["draft"]
    t = time.perf_counter()
    target_continuations(lt.model, prompts, params, a.max_new_tokens, stops, 0, a.batch_size)
    plain_s = time.perf_counter() - t
    live, tf = r["live"], r["teacher_forced"]
    tf_scratch_ms = 1000 * (tf["seconds"] + plain_s) / max(tf["positions"], 1)
    report = {
        "benchmark": "teacher_forced_vs_live", **provenance(draft=src, dataset=a.dataset, limit=a.limit,
                                                            max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                                            threads=torch.get_num_threads()),
        "live": {"positions": live["positions"], "seconds": live["seconds"], "ms_per_position": live["ms_per_position"],
                 "tau": live["tau"]},
        "teacher_forced": {"positions": tf["positions"], "seconds": tf["seconds"],
                           "ms_per_position": tf["ms_per_position"], "tau": tf["tau"]},
        "plain_decoding_seconds": round(plain_s, 3),
        "teacher_forced_from_scratch_ms_per_position": round(tf_scratch_ms, 4),
        "speedup_per_position": round(live["ms_per_position"] / tf["ms_per_position"], 2),
        "speedup_per_position_from_scratch": round(live["ms_per_position"] / tf_scratch_ms, 2),
        **provenance_of(__file__),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
