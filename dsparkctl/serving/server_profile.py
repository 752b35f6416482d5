"""`profile-sps --server`: the step cost of the engine a user serves with, measured from outside.

A *round* sends R streamed completions at once (R = a concurrency from `--requests`), each a
prompt of exactly C token ids (distinct random ids, so no prefix cache helps) and exactly O
output tokens (`ignore_eos`). While all R decode together (the *steady window*: from the last
first chunk to the first last chunk) each engine step emits one chunk per request, so

    step time     the median over the R requests of their mean gap between chunks in the window
    batch tokens  B = R · (1 + draft tokens / request-steps) tokens verified per step: vLLM's
                  counters around the round (request-steps = generated − accepted tokens); a
                  server without speculation verifies one token per request (B = R); SGLang, which
                  exports no draft-token counter, verifies its configured draft tokens every step
    tokens/step   generated tokens per request-step (1 + accepted drafts: the served τ)
    drafted share request-steps that verified a draft (vLLM's drafts / request-steps)

`warmup` rounds per level are discarded; `repeats` rounds are kept and reduced to their median
(and spread). The levels' (B, step time) points, fitted non-decreasing in B, make a 1-D SPS
table: what SGLang reads and what `sweep-scheduler` and `serve-config` price steps with (a
server packs ragged rows, so the cost is by batch tokens). A server without speculation gives
plain steps (B = R); one with it gives drafted steps at its configured length; a table may pool
both servers' points (`--server` twice), each point labelled with what it measured.
"""

from __future__ import annotations

import math
import socket
import statistics
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.formats.served_scrape import engine_totals
from dsparkctl.math.step_grid import isotonic
from dsparkctl.serving.served import fetch_url, printable, shown
from dsparkctl.serving.stream_client import Streamed, abort, endpoint, get_json, stream_completion

ID_RANGE = (256, 20000)  # prompt token ids: below every tokenizer in use (Llama 32k, SmolLM 49k, Qwen 151k, ...)
MIN_WINDOW_CHUNKS = 4  # chunks each request needs inside the steady window


@dataclass(frozen=True)
class Server:
    """What the server said about itself before any load."""
    url: str
    model: str
    engine: str | None  # "vllm" | "sglang" | None (an OpenAI server that exports neither's metrics)
    version: str | None
    metrics: bool  # /metrics answers Prometheus text
    positions: int | None  # drafts per step it is configured for (None: no speculation seen)
    sglang_draft_tokens: int | None = None  # SGLang's speculative_num_draft_tokens (tokens verified per request)
    max_model_len: int | None = None  # the longest prompt + output it takes, where it says (vLLM)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "server": shown(self.url), "model": printable(self.model),
                "speculative": None if self.positions is None else {"positions": self.positions}}


def _metrics_text(url: str) -> str | None:
    scheme, _, _, base, _ = endpoint(url)  # the netloc keeps its credentials: fetch_url sends them
    try:
        return fetch_url(urllib.parse.urlunsplit((scheme, urllib.parse.urlsplit(url).netloc, base + "/metrics", "", "")))
    except InputError as exc:
        if "HTTP 404" in exc.message:
            return None
        raise


def identify(url: str, model: str | None) -> Server:
    """Ask the server what it serves (`/v1/models`), which engine and version it is and whether it
    speculates (its /metrics, `/version`, SGLang's `/get_server_info`). One line if it is not an
    OpenAI-compatible server or does not serve `model`."""
    listed = get_json(url, "/v1/models")
    entries = {m.get("id"): m for m in listed.get("data", []) if isinstance(m, dict)} if isinstance(listed, dict) else {}
    ids = list(entries)
    if not ids or not all(isinstance(i, str) for i in ids):
        raise InputError(f"{shown(url)}/v1/models did not list models the OpenAI way",
                         f"point {option('server')} at an OpenAI-compatible vLLM or SGLang server (http://HOST:PORT)")
    if model is None:
        if len(ids) > 1:
            raise UsageError(f"{shown(url)} serves {len(ids)} models", f"pick one with {option('model')} (one of {', '.join(ids[:5])})")
        model = ids[0]
    elif model not in ids:
        raise UsageError(f"{shown(url)} does not serve model {model!r}", f"use {option('model')} with one of {', '.join(ids[:5])}")
    text = _metrics_text(url)
    totals = engine_totals(text, f"{shown(url)}/metrics", model) if text is not None else None
    engine = totals["engine"] if totals else None
    info = get_json(url, "/get_server_info") if engine != "vllm" else None
    version = get_json(url, "/version") if engine != "sglang" else None
    positions, sg_tokens = None, None
    if totals and totals["spec"] is not None and totals["spec"].kind != "gauges":
        positions = totals["spec"].positions
    if isinstance(info, dict):
        engine = engine or "sglang"
        version = info.get("version")
        if info.get("speculative_algorithm") not in (None, "", "NONE") and isinstance(
                info.get("speculative_num_draft_tokens"), int):
            sg_tokens = info["speculative_num_draft_tokens"]
            positions = sg_tokens - 1
    elif isinstance(version, dict):
        version = version.get("version")
    limit = entries[model].get("max_model_len")  # vLLM lists it; prompt + output must fit
    return Server(url=url, model=model, engine=engine, version=printable(str(version)) if version is not None else None,
                  metrics=text is not None, positions=positions, sglang_draft_tokens=sg_tokens,
                  max_model_len=limit if isinstance(limit, int) and not isinstance(limit, bool) else None)


@dataclass
class RoundResult:
    requests: int
    step_ms: float
    batch_tokens: float
    tokens_per_step: float
    drafted_share: float | None
    seconds: float


def _counters(server: Server) -> tuple[int | None, Any]:
    if not server.metrics or server.engine != "vllm":
        return None, None
    t = engine_totals(_metrics_text(server.url) or "", f"{shown(server.url)}/metrics", server.model)
    return t["generation_tokens"], t["spec"]


def run_round(server: Server, requests: int, context_len: int, output_tokens: int, seed: int,
              stall_s: float, deadline: float = math.inf) -> RoundResult:
    """R streams at once; their steady-window step time and what each step verified."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(*ID_RANGE, (requests, context_len), generator=g).tolist()
    extra = {"return_token_ids": True} if server.engine == "vllm" else None  # tokens per chunk (vLLM)
    gen0, spec0 = _counters(server)
    start = time.monotonic()
    got = _streams(server, prompts, output_tokens, stall_s, extra, deadline)
    seconds = time.monotonic() - start
    generated = sum(s.completion_tokens or 0 for s in got)
    gen1, spec1 = _settled_counters(server, gen0, generated)
    for s in got:
        if s.prompt_tokens is not None and s.prompt_tokens != context_len:
            raise InputError(f"{shown(server.url)} counted {s.prompt_tokens} prompt tokens where {context_len} ids "
                             "were sent", "the server rewrote the prompt (a chat template?): use a completions endpoint")
    per_row, tau, drafted = _verified(server, got, generated, (gen0, spec0), (gen1, spec1))
    return RoundResult(requests=requests, step_ms=1000 * _window_step(got, requests, server.url, tau),
                       batch_tokens=requests * per_row, tokens_per_step=tau, drafted_share=drafted, seconds=seconds)


def _streams(server: Server, prompts: list[list[int]], output_tokens: int, stall_s: float,
             extra: dict[str, Any] | None, deadline: float) -> list[Streamed]:
    """The round's streams, one daemon thread each. Ctrl-C, SIGTERM or the deadline cut them all at
    once (their sockets shut), so a stop never waits for a slow or silent server."""
    opened: list[Any] = []
    results: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = stream_completion(server.url, server.model, prompts[i], output_tokens, stall_s, extra, opened)
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
            results[i] = exc
    threads = [threading.Thread(target=one, args=(i,), daemon=True, name=f"stream-{i}") for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.1)
                if time.monotonic() > deadline:
                    raise InputError(f"the grid ran past its {option('time_limit')} in the middle of a round; "
                                     "nothing written", f"use fewer {option('requests')}, {option('repeats')} or "
                                     f"{option('output_tokens')}, or raise {option('time_limit')}")
    except BaseException:
        abort(opened)
        raise
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _verified(server: Server, got: Sequence[Streamed], generated: int, before: tuple[int | None, Any],
              after: tuple[int | None, Any]) -> tuple[float, float, float | None]:
    """(tokens verified per request-step, tokens emitted per request-step τ, drafted share): from
    vLLM's counters (request-steps = generated − accepted), a plain server's one token, or SGLang's
    configured draft tokens (its τ from the chunks, where each holds one step)."""
    (gen0, spec0), (gen1, spec1) = before, after
    chunks = sum(len(s.chunks) for s in got)
    if server.sglang_draft_tokens is not None:
        return float(server.sglang_draft_tokens), generated / max(chunks, 1), None
    if spec1 is not None and gen1 is not None and gen0 is not None and spec1.draft_tokens is not None:
        d_tokens = spec1.draft_tokens - (spec0.draft_tokens if spec0 and spec0.draft_tokens is not None else 0)
        accepted = spec1.accepted_tokens - (spec0.accepted_tokens if spec0 else 0)
        steps = max(gen1 - gen0 - accepted, 1)
        return 1 + d_tokens / steps, (gen1 - gen0) / steps, (spec1.drafts - (spec0.drafts if spec0 else 0)) / steps
    if server.engine == "vllm" and server.metrics and server.positions is None:
        return 1.0, 1.0, 0.0  # vLLM without speculation: one token per request-step, however chunks group them
    if generated > chunks * 1.05:
        raise InputError(f"{shown(server.url)} emits several tokens per chunk but exports no counters of the tokens "
                         "it verified", "enable the server's /metrics (vLLM has it by default; SGLang: "
                         "--enable-metrics)")
    return 1.0, 1.0, 0.0


def _settled_counters(server: Server, gen0: int | None, ours: int) -> tuple[int | None, Any]:
    """The counters after a round, once they count all of its tokens (an engine may publish a step's
    counts a moment after streaming it). More than ours: another client shared the server, or
    fewer than before: it restarted; either way the round's batch tokens are not ours to read."""
    for _ in range(20):
        gen1, spec1 = _counters(server)
        if gen1 is None or gen0 is None or gen1 - gen0 >= ours:
            break
        time.sleep(0.1)
    if gen1 is not None and gen0 is not None and gen1 - gen0 > ours:
        raise InputError(f"{shown(server.url)}'s counters moved by {gen1 - gen0 - ours} tokens more than this "
                         f"round's {ours}: another client used it",
                         "profile a server no one else is using (its batch would not be this profile's)")
    if gen1 is not None and gen0 is not None and gen1 - gen0 < ours:
        raise InputError(f"{shown(server.url)}'s counters moved by fewer tokens than this round streamed: it "
                         "restarted", "profile again once the server runs steadily (check its log)")
    return gen1, spec1


def _window_step(got: Sequence[Streamed], requests: int, url: str, tau: float) -> float:
    """Median over the requests of their time per step while all of them were decoding: the span
    between their first and last chunk in that window over the steps it held (tokens after the
    first chunk / τ where the server counts each chunk's tokens, since an engine may group several
    steps' tokens into one chunk; else one step per chunk)."""
    lo, hi = max(s.chunks[0] for s in got), min(s.chunks[-1] for s in got)
    per_step = []
    for s in got:
        inside = [(t, n) for t, n in zip(s.chunks, s.chunk_tokens) if lo <= t <= hi]
        if len(inside) < MIN_WINDOW_CHUNKS:
            raise InputError(f"{shown(url)} did not decode {requests} requests together for {MIN_WINDOW_CHUNKS} steps "
                             "(it queues some: its max-num-seqs, or a slow prefill)",
                             f"use a {option('requests')} grid within the server's concurrency, or more "
                             f"{option('output_tokens')}")
        counted = all(n is not None for _, n in inside)
        steps = sum(n for _, n in inside[1:]) / tau if counted else len(inside) - 1
        per_step.append((inside[-1][0] - inside[0][0]) / steps)
    return statistics.median(per_step)


@dataclass
class Plan:
    """The grid, bounded before the first request is sent."""
    requests: list[int]
    context_lens: list[int]
    output_tokens: int
    repeats: int
    warmup: int
    time_limit_s: float
    rounds: list[tuple[int, int, bool]] = field(default_factory=list)  # (context, R, kept)

    def __post_init__(self) -> None:
        self.rounds = [(c, r, i >= self.warmup) for c in self.context_lens for r in self.requests
                       for i in range(self.warmup + self.repeats)]

    @property
    def total_requests(self) -> int:
        return sum(r for _, r, _ in self.rounds)


def profile_servers(servers: Sequence[Server], plan: Plan, seed: int, stall_s: float,
                    on_round: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Every round of the plan on each server in turn, stopped (InputError, nothing kept) as soon as
    the rounds run so far say the rest cannot finish within the time limit. Returns one point per
    (server, context, R), each labelled with its server."""
    rounds = [(k, c, r, keep) for k in range(len(servers)) for c, r, keep in plan.rounds]
    start, seen = time.monotonic(), {}
    kept: dict[tuple[int, int, int], list[RoundResult]] = {}
    for i, (k, c, r, keep) in enumerate(rounds):
        res = run_round(servers[k], r, c, plan.output_tokens, seed + i, stall_s, start + plan.time_limit_s)
        seen[(k, c, r)] = res.seconds
        if keep:
            kept.setdefault((k, c, r), []).append(res)
        if on_round:
            on_round(i + 1, len(rounds))
        elapsed = time.monotonic() - start
        ahead = sum(_projected(seen, *key[:3]) for key in rounds[i + 1:])
        if elapsed + ahead > plan.time_limit_s:
            raise InputError(f"the grid would take about {elapsed + ahead:.0f} s, over {option('time_limit')} "
                             f"{plan.time_limit_s:g} s (after {i + 1} of {len(rounds)} rounds); nothing written",
                             f"use fewer {option('requests')}, {option('repeats')} or {option('output_tokens')}, "
                             f"or raise {option('time_limit')}")
    return [{**_point(c, r, res), "server": shown(servers[k].url)} for (k, c, r), res in kept.items()]


def _projected(seen: dict[tuple[int, int, int], float], k: int, c: int, r: int) -> float:
    """A round's time from the rounds run so far: its own level's, or the nearest level measured
    (on this server where it has one) scaled by R^α · (context ratio)^½. α is how round time grew
    with R between two levels measured at one context (within [0, 1]); 1 (linear, the upper bound
    of a server that batches) until two are."""
    if (k, c, r) in seen:
        return seen[(k, c, r)]
    mine = {key: t for key, t in seen.items() if key[0] == k} or seen
    (_, c0, r0), t0 = min(mine.items(), key=lambda kv: (abs(kv[0][1] - c), abs(kv[0][2] - r)))
    same = sorted((key[2], t) for key, t in mine.items() if key[1] == c0)
    alpha = 1.0
    if len(same) >= 2 and same[-1][0] > same[0][0]:
        growth = math.log(max(same[-1][1], 1e-9) / max(same[0][1], 1e-9)) / math.log(same[-1][0] / same[0][0])
        alpha = min(max(growth, 0.0), 1.0)
    return t0 * max(r / r0, 1.0) ** alpha * max(c / c0, 1.0) ** 0.5


def _point(c: int, r: int, rounds: list[RoundResult]) -> dict[str, Any]:
    ms = sorted(x.step_ms for x in rounds)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    shares = [x.drafted_share for x in rounds if x.drafted_share is not None]
    return {"context_len": c, "requests": r, "rounds": len(rounds),
            "kind": "drafted" if statistics.median(x.batch_tokens for x in rounds) > r * 1.001 else "plain",
            "step_ms": statistics.median(ms), "step_ms_quartiles": [q[0], q[2]], "step_ms_range": [ms[0], ms[-1]],
            "batch_tokens": statistics.median(x.batch_tokens for x in rounds),
            "tokens_per_step": statistics.median(x.tokens_per_step for x in rounds),
            "drafted_share": statistics.median(shares) if shares else None}


def fit_points(points: Sequence[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(batch tokens, steps/s) from measured points: B rounded to whole tokens (points landing on
    one B are averaged in step time), step time made non-decreasing in B (isotonic, weighted by
    how many points each B pools)."""
    by_b: dict[int, list[float]] = {}
    for p in points:
        by_b.setdefault(max(1, round(p["batch_tokens"])), []).append(p["step_ms"])
    bs = sorted(by_b)
    fitted = isotonic([statistics.fmean(by_b[b]) for b in bs], [len(by_b[b]) for b in bs])
    return bs, [1000.0 / ms for ms in fitted]


def same_server_key(url: str) -> tuple[str, frozenset[str], int, str]:
    """What makes two URLs one server: scheme, the addresses the host resolves to, port, base path
    (http://localhost:8000/v1/ and http://127.0.0.1:8000 are one)."""
    scheme, host, port, base, _ = endpoint(url)
    try:
        addrs = frozenset(a[4][0] for a in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP))
    except (OSError, UnicodeError):
        addrs = frozenset({host.lower()})
    return scheme, addrs, port, base


def check_servers(servers: Sequence[Server], longest: int) -> None:
    """Servers pooled into one table serve one model, and each takes the longest request sent."""
    models = sorted({s.model for s in servers})
    if len(models) > 1:
        raise UsageError(f"the servers serve different models ({', '.join(printable(m) for m in models)}): one table "
                         "would mix their step costs", "pool only servers of one model (and name it with "
                         f"{option('model')} where they list several)")
    for s in servers:
        if s.max_model_len is not None and longest > s.max_model_len:
            raise UsageError(f"{shown(s.url)} takes at most {s.max_model_len} tokens per request; the longest "
                             f"{option('context_len')} plus {option('output_tokens')} is {longest}",
                             f"keep {option('context_len')} + {option('output_tokens')} within {s.max_model_len}")
