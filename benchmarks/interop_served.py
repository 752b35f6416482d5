"""Served-acceptance files made by the engines' OWN classes, fed known rounds (issue 27).

Runs inside the side virtualenvs of benchmarks/interop_check.sh (it imports no dsparkctl code).
Reads the rounds of one of our traces (`dsparkctl generate --trace`: per round ℓ verified drafts
and `accepted`) and replays them through the engine's own accounting:

  vllm    `vllm.v1.spec_decode.metrics.SpecDecodingStats` + `SpecDecodingProm` (the Prometheus
          counters, scraped with prometheus_client.generate_latest halfway and at the end: two
          scrapes of one server run) and `vllm.v1.metrics.stats.RequestSpecDecodeMetrics` per
          request, wrapped in vLLM's own response models (`ChatCompletionResponse.metrics`), at
          the `summary` and the `detailed` level;
  sglang  `Req.update_spec_correct_drafts_histogram` / `update_spec_cap_lens_histogram` per
          step and `TokenizerManager._calculate_spec_decoding_metrics` for each request's
          meta_info (its `get_spec()` lookup answered with the block size: no server runs).

`--lengths full` (the default) keeps the trace's full-verification rounds (every draft γ long);
`recorded` every drafted round as recorded (the rounds cut short at a request's end included);
`mixed` shortens the full ones as a per-batch-size length table would: a round that accepted a of
γ drafts, drafted with ℓ' ≤ γ, accepts min(a, ℓ').
`expected.json` holds the true counts, per position the steps that tested it, and so the true
conditional acceptance, for benchmarks/interop_served_check.py to compare with `dsparkctl served`.

Usage: python interop_served.py vllm|sglang TRACE OUTDIR [--lengths full|recorded|mixed] [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

MIXED = (5, 2, 3, 1, 5, 4, 2)  # the draft lengths cycled through under --lengths mixed (capped at γ)


def read_rounds(trace: Path, lengths: str) -> tuple[int, list[list[tuple[int, int]]]]:
    """(γ, per request its (drafted, accepted) steps)."""
    lines = trace.read_text().splitlines()
    header = json.loads(lines[0])
    reqs: dict[int, list[tuple[int, int, int]]] = {}
    gamma = int(header.get("block_size") or 0)
    i = 0
    for line in lines[1:]:
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("drafted", True) is False or r["verify_length"] == 0:
            continue
        gamma = r["block_size"]
        ell, acc = r["verify_length"], r["accepted"]
        if lengths != "recorded" and (ell != gamma or r.get("budget_capped")):
            continue  # only full-verification rounds say what a shorter draft would have accepted
        if lengths == "mixed":
            ell = min(MIXED[i % len(MIXED)], gamma)
            acc = min(acc, ell)
            i += 1
        reqs.setdefault(r["request"], []).append((r["round"], ell, acc))
    return gamma, [[(e, a) for _, e, a in sorted(v)] for _, v in sorted(reqs.items())]


def expected(gamma: int, requests: list[list[tuple[int, int]]]) -> dict:
    steps = [s for r in requests for s in r]
    tested = [sum(1 for e, a in steps if e >= k and a >= k - 1) for k in range(1, gamma + 1)]
    accepted = [sum(1 for _, a in steps if a >= k) for k in range(1, gamma + 1)]
    return {"gamma": gamma, "requests": len(requests), "drafts": len(steps), "draft_tokens": sum(e for e, _ in steps),
            "accepted_tokens": sum(a for _, a in steps), "accepted_at": accepted, "tested": tested,
            "conditional": [a / n if n else None for a, n in zip(accepted, tested)]}


def run_vllm(gamma: int, requests, out: Path, model: str) -> None:
    import prometheus_client
    from vllm.entrypoints.generate.base.protocol import PerRequestMetrics, SpeculativeDecodingMetrics
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    prom = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=gamma), ["model_name", "engine"],
                            {0: [model, "0"]})
    half = len(requests) // 2
    for i, steps in enumerate(requests):
        if i == half:
            (out / "scrape_mid.txt").write_bytes(prometheus_client.generate_latest())
        for ell, acc in steps:  # one scheduler step per round: vLLM aggregates steps, the counts are the same
            st = SpecDecodingStats.new(gamma)
            st.observe_draft(num_draft_tokens=ell, num_accepted_tokens=acc)
            prom.observe(st, engine_idx=0)
    (out / "scrape_end.txt").write_bytes(prometheus_client.generate_latest())
    for level in ("summary", "detailed"):
        with open(out / f"responses_{level}.jsonl", "w") as fh:
            for i, steps in enumerate(requests):
                m = RequestSpecDecodeMetrics.new(gamma)
                for ell, acc in steps:
                    m.observe(num_draft_tokens=ell, num_accepted=acc, detailed=level == "detailed")
                n = sum(1 + a for _, a in steps)
                resp = ChatCompletionResponse(
                    id=f"chatcmpl-{i}", model=model, choices=[],
                    usage=UsageInfo(prompt_tokens=1, completion_tokens=n, total_tokens=1 + n),
                    metrics=PerRequestMetrics(speculative_decoding=SpeculativeDecodingMetrics(**m.to_dict())))
                fh.write(resp.model_dump_json() + "\n")
    half_exp = expected(gamma, requests[half:])
    (out / "expected.json").write_text(json.dumps({"all": expected(gamma, requests), "window": half_exp}, indent=1))


def run_sglang(gamma: int, requests, out: Path, ragged: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import interop_sglang  # the torchvision stand-in (see there)

    sys.meta_path.insert(0, interop_sglang._InertTorchvision())
    if ragged:
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "compact"
    from sglang.srt.managers import tokenizer_manager as tm
    from sglang.srt.managers.schedule_batch import Req

    tm.get_spec = lambda: types.SimpleNamespace(speculative_num_draft_tokens=gamma + 1, speculative_algorithm="DSPARK")
    with open(out / "responses.jsonl", "w") as fh:
        for i, steps in enumerate(requests):
            req = types.SimpleNamespace(spec_correct_drafts_histogram=[], spec_cap_lens_histogram=[])
            for ell, acc in steps:
                Req.update_spec_correct_drafts_histogram(req, acc)
                if ragged:
                    Req.update_spec_cap_lens_histogram(req, ell + 1)  # the verify window holds the bonus slot
            n = sum(1 + a for _, a in steps) + 1  # the first token comes from the prefill
            recv = types.SimpleNamespace(
                spec_verify_ct=[len(steps)], spec_num_correct_drafts=[sum(a for _, a in steps)],
                completion_tokens=[n], spec_num_cap_tokens=[sum(e + 1 for e, _ in steps)] if ragged else None,
                spec_num_block_accept_tokens=None, spec_correct_drafts_histogram=[req.spec_correct_drafts_histogram],
                spec_cap_lens_histogram=[req.spec_cap_lens_histogram] if ragged else None)
            meta: dict = {"id": f"req-{i}", "finish_reason": {"type": "length"}, "completion_tokens": n}
            tm.TokenizerManager._calculate_spec_decoding_metrics(None, meta, recv, 0)
            fh.write(json.dumps({"text": "", "meta_info": meta}) + "\n")
    (out / "expected.json").write_text(json.dumps({"all": expected(gamma, requests)}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=("vllm", "sglang"))
    ap.add_argument("trace", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", choices=("full", "recorded", "mixed"), default="full")
    ap.add_argument("--model", default="smollm2-135m-dspark")
    args = ap.parse_args()
    gamma, requests = read_rounds(args.trace, args.lengths)
    if not requests:
        sys.exit(f"{args.trace}: no drafted rounds")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine == "vllm":
        run_vllm(gamma, requests, args.out, args.model)
    else:
        run_sglang(gamma, requests, args.out, ragged=args.lengths != "full")
    print(f"wrote {args.engine} files for {len(requests)} requests ({args.lengths} lengths) to {args.out}")


if __name__ == "__main__":
    main()
