"""Does a table measured by `profile-sps --server` predict what the same server delivers?

For each concurrency R: R streamed completions at once of real MT-Bench prompts (text, not the
profile's random ids) with a fixed output length, repeated over distinct prompts. Measured, by
the client: output tokens per second of all R requests together while every one of them decodes
(from the last first chunk to the first last chunk; tokens per chunk from vLLM's token_ids), the
median over rounds; the per-request decode rate Σ_i (tokens_i − 1) / (last_i − first_i), which
also counts the tails where fewer requests run, is kept beside it. Predicted, from the
table's step cost and this run's own acceptance (the server's counters around the round; the
table says nothing about acceptance): R · τ / step_seconds(B), with τ = generated tokens per
request-step and B = R · (1 + draft tokens per request-step). A table measured at several context
lengths (`--context-len 64,512`) prices the step at the round's mean prompt length, linearly
between the two measured contexts around it (clamped to the measured range); the prediction
from the first context alone is kept beside it.

Usage: python benchmarks/served_profile_check.py URL TABLE [--requests 1,2,4,8] [--rounds 3]
       [--output-tokens 64] [--out results.json] [--scrapes DIR]
`--scrapes DIR` saves the /metrics scrapes before the first and after the last round (for
`dsparkctl served DIR/before.txt DIR/after.txt`). `--responses FILE` then sends N short prompts (one
MT-Bench question) and N long ones (eight questions in one message) one at a time (chat completions,
not streamed) and keeps their bodies as JSON lines, for `served --context-buckets`: with vLLM's
`--per-request-spec-decode-metrics detailed` they carry per-step counts, so `dsparkctl served FILE`
gives exact conditionals even where ngram drafts of different lengths are mixed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dsparkctl.data.prompts import load_prompts
from dsparkctl.formats.served_scrape import engine_totals
from dsparkctl.formats.sps import load_sps_table, table_for_context
from dsparkctl.serving import stream_client
from dsparkctl.serving.served import fetch_url
from dsparkctl.serving.server_profile import identify


def stream_text(url: str, model: str, prompt: str, max_tokens: int) -> stream_client.Streamed:
    """One completion of a text prompt (stream_client sends token ids; here the server tokenizes)."""
    return stream_client.stream_completion(url, model, prompt, max_tokens, extra={"return_token_ids": True})


def steady_throughput(got: list[stream_client.Streamed]) -> float:
    """Output tokens per second, all requests together, while every one of them was decoding (from the
    last first chunk to the first last chunk; each chunk's tokens as the server's token_ids count them)."""
    lo, hi = max(s.chunks[0] for s in got), min(s.chunks[-1] for s in got)
    tokens = sum(n for s in got for t, n in zip(s.chunks, s.chunk_tokens) if lo < t <= hi)
    return tokens / (hi - lo)


def step_seconds(table, R: int, B: float, context: float) -> float:
    """The table's step time at R requests and B batch tokens, at `context` prompt tokens."""
    at = lambda t: float(t.step_seconds(R, torch.tensor([B], dtype=torch.float64))[0])  # noqa: E731
    contexts = sorted(e["context_len"] for e in table.meta.get("by_context", []))
    if len(contexts) < 2:
        return at(table)
    c = min(max(context, contexts[0]), contexts[-1])
    hi = next(x for x in contexts if x >= c)
    lo = max(x for x in contexts if x <= c)
    if hi == lo:
        return at(table_for_context(table, lo))
    w = (c - lo) / (hi - lo)
    return (1 - w) * at(table_for_context(table, lo)) + w * at(table_for_context(table, hi))


def counters(url: str, model: str):
    text = fetch_url(url + "/metrics")
    t = engine_totals(text, url, model)
    spec = t["spec"]
    return text, t["generation_tokens"], (spec.drafts, spec.draft_tokens, spec.accepted_tokens) if spec else (0, 0, 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("table")
    ap.add_argument("--requests", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out")
    ap.add_argument("--scrapes")
    ap.add_argument("--responses")
    ap.add_argument("--responses-count", type=int, default=24)
    a = ap.parse_args()
    server = identify(a.url, None)
    table = load_sps_table(a.table)
    prompts = load_prompts("mt-bench")
    rows, first_scrape, k = [], None, 0
    for R in [int(x) for x in a.requests.split(",")]:
        per_round = []
        for _ in range(a.rounds):
            batch = [prompts[(k + i) % len(prompts)] for i in range(R)]
            k += R
            text0, g0, (d0, t0, acc0) = counters(a.url, server.model)
            first_scrape = first_scrape or text0
            with ThreadPoolExecutor(max_workers=R) as pool:
                got = list(pool.map(lambda p: stream_text(a.url, server.model, p, a.output_tokens), batch))
            last_scrape, g1, (d1, t1, acc1) = counters(a.url, server.model)
            if any(n is None for s in got for n in s.chunk_tokens):
                raise SystemExit("the server does not return token_ids per chunk (vLLM's return_token_ids)")
            measured = steady_throughput(got)
            whole = sum((s.completion_tokens - 1) / (s.chunks[-1] - s.chunks[0]) for s in got)
            steps = (g1 - g0) - (acc1 - acc0)  # request-steps: each yields 1 + its accepted drafts
            tau = (g1 - g0) / steps
            B = R * (1 + (t1 - t0) / steps)
            context = statistics.fmean(s.prompt_tokens for s in got)
            step_s = step_seconds(table, R, B, context)
            first_s = float(table.step_seconds(R, torch.tensor([B], dtype=torch.float64))[0])
            per_round.append({"measured_tok_s": measured, "per_request_decode_tok_s": whole,
                              "predicted_tok_s": R * tau / step_s, "predicted_first_context_tok_s": R * tau / first_s,
                              "mean_prompt_tokens": context, "tau": tau,
                              "batch_tokens": B, "drafted_share": (d1 - d0) / steps})
        med = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
        err = med["predicted_tok_s"] / med["measured_tok_s"] - 1
        rows.append({"requests": R, **med, "error": err, "rounds": per_round})
        print(f"R={R:<3} B={med['batch_tokens']:6.2f} τ={med['tau']:.3f} prompt {med['mean_prompt_tokens']:5.0f} measured {med['measured_tok_s']:8.2f} tok/s, "
              f"predicted {med['predicted_tok_s']:8.2f} tok/s, error {100 * err:+6.1f}% "
              f"{'ok' if abs(err) <= 0.10 else 'OUTSIDE ±10%'}", flush=True)
    if a.scrapes:
        Path(a.scrapes).mkdir(parents=True, exist_ok=True)
        Path(a.scrapes, "before.txt").write_text(first_scrape)
        Path(a.scrapes, "after.txt").write_text(last_scrape)
    if a.responses:  # short prompts (one MT-Bench question) and long ones (eight questions in one message)
        short = prompts[-a.responses_count:]
        long = ["\n\n".join(prompts[i:i + 8]) for i in range(0, 8 * a.responses_count, 8)]
        with open(a.responses, "w") as fh:
            for q in short + long:
                body = json.dumps({"model": server.model, "messages": [{"role": "user", "content": q}],
                                   "max_tokens": a.output_tokens, "temperature": 0}).encode()
                req = urllib.request.Request(a.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    fh.write(json.dumps(json.loads(r.read())) + "\n")
    doc = {"server": server.describe(), "table": a.table, "output_tokens": a.output_tokens, "rounds": a.rounds,
           "prompts": "mt-bench (text, completions endpoint)", "rows": rows,
           "within_10pct": all(abs(r["error"]) <= 0.10 for r in rows)}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if doc["within_10pct"] else 1


if __name__ == "__main__":
    sys.exit(main())
