"""`profile-sps --server`: check the grid, the time bound and every output, ask each server what it
is, run the bounded load (serving/server_profile.py), fit the table and write ours, SGLang's twin
and the PNG together (or nothing, on any failure)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs
from dsparkctl.errors import UsageError, option
from dsparkctl.files.atomic import staged
from dsparkctl.formats.sps import save_sps_table
from dsparkctl.math.sps import SPSTable
from dsparkctl.plots import plot_sps
from dsparkctl.provenance import provenance
from dsparkctl.serving.server_profile import Plan, check_servers, fit_points, identify, profile_servers, same_server_key
from dsparkctl.serving.served import _check_url, is_url, shown
from dsparkctl.serving.stream_client import STALL_S

MAX_SERVER_REQUESTS = 1024  # concurrent requests in one round
MAX_REPEATS = 100
MAX_TOKENS = 32768  # context or output tokens per request
MAX_TIME_LIMIT_S = 7 * 24 * 3600


@dataclass(frozen=True)
class ServerProfileSpec:
    """Everything `profile-sps --server` runs, as the user gave it."""
    servers: tuple[str, ...]  # OpenAI-compatible base URLs (http://HOST:PORT); several pool their points
    model: str | None = None  # the served model name; None: the one the server lists
    out: Path = Path("sps.json")
    sglang_out: Path | None = None  # None: <out stem>.sglang.json
    plot: Path | None = None  # None: <out stem>.png
    requests: tuple[int, ...] = (1, 2, 4, 8)  # concurrencies
    context_lens: tuple[int, ...] = (256,)  # prompt tokens per request; the first makes the table
    output_tokens: int = 64  # generated tokens per request (ignore_eos)
    repeats: int = 5  # kept rounds per level (median and spread)
    warmup: int = 1  # discarded rounds per level
    time_limit: float = 600.0  # seconds for the whole grid; stopped, nothing written, once it cannot fit
    stall_s: float = STALL_S  # longest silence inside one stream
    seed: int = 0


def check_server_spec(spec: ServerProfileSpec) -> Plan:
    """Numbers, URLs and every output path, before the first request."""
    if not spec.servers:
        raise UsageError(f"{option('server')} names no server", "give http://HOST:PORT of a vLLM or SGLang server")
    for url in spec.servers:
        if not is_url(url):
            raise UsageError(f"{option('server')} {shown(url)!r} is not an http(s) URL", "give http://HOST:PORT")
        _check_url(url, "http://HOST:PORT")
    where = [same_server_key(url) for url in spec.servers]
    if len(set(where)) != len(where):
        raise UsageError(f"{option('server')} names one server twice (its points would count twice)",
                         "name each server once")
    if max(spec.requests) > MAX_SERVER_REQUESTS:
        raise UsageError(f"{option('requests')} {max(spec.requests)} is more than {MAX_SERVER_REQUESTS} concurrent "
                         "requests", f"use concurrencies up to {MAX_SERVER_REQUESTS}")
    if len(set(spec.requests)) != len(spec.requests) or len(set(spec.context_lens)) != len(spec.context_lens):
        raise UsageError(f"{option('requests')} and {option('context_len')} must not repeat a value",
                         "name each concurrency and context length once")
    if not 1 <= spec.repeats <= MAX_REPEATS or not 0 <= spec.warmup <= MAX_REPEATS:
        raise UsageError(f"{option('repeats')} must be in 1..{MAX_REPEATS} and {option('warmup')} in 0..{MAX_REPEATS}",
                         f"e.g. {option('repeats')} 5 {option('warmup')} 1")
    if not MIN_OUTPUT <= spec.output_tokens <= MAX_TOKENS or max(spec.context_lens) > MAX_TOKENS:
        raise UsageError(f"{option('output_tokens')} must be in {MIN_OUTPUT}..{MAX_TOKENS} and {option('context_len')} "
                         f"at most {MAX_TOKENS}", f"e.g. {option('output_tokens')} 64 {option('context_len')} 256")
    if not 1 <= spec.time_limit <= MAX_TIME_LIMIT_S:
        raise UsageError(f"{option('time_limit')} must be 1..{MAX_TIME_LIMIT_S} seconds, got {spec.time_limit:g}",
                         f"e.g. {option('time_limit')} 600")
    check_outputs([Output(spec.out, option("out"))], [],
                  derived=lambda out: [Output(_named(spec, out)[0], option("sglang_out")),
                                       Output(_named(spec, out)[1], option("plot"), "figure")])
    return Plan(requests=sorted(spec.requests), context_lens=list(spec.context_lens), output_tokens=spec.output_tokens,
                repeats=spec.repeats, warmup=spec.warmup, time_limit_s=spec.time_limit)


MIN_OUTPUT = 8  # a steady window needs a few steps after the last request's first token


def _named(spec: ServerProfileSpec, out: Path) -> tuple[Path, Path]:
    return spec.sglang_out or out.with_name(out.stem + ".sglang.json"), spec.plot or out.with_suffix(".png")


def run_profile_server(spec: ServerProfileSpec, *, log: Callable[[str], None] = lambda m: None,
                       on_progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, Any], SPSTable]:
    """Check, identify the servers, announce the bound, profile, fit, write. Returns (document, table)."""
    plan = check_server_spec(spec)
    servers = [identify(url, spec.model) for url in spec.servers]
    check_servers(servers, max(spec.context_lens) + spec.output_tokens)
    n_rounds = len(plan.rounds) * len(servers)
    log(f"{n_rounds} rounds, {plan.total_requests * len(servers)} requests of {'/'.join(map(str, plan.context_lens))} "
        f"prompt + {plan.output_tokens} output tokens, stopped if it cannot finish within {spec.time_limit:g} s")
    for server in servers:
        log(f"{shown(server.url)}: {server.engine or 'unknown engine'} {server.version or ''}, model {server.model}, "
            + (f"speculating {server.positions} drafts per step" if server.positions else "no speculation seen"))
    points = profile_servers(servers, plan, spec.seed, spec.stall_s, on_round=on_progress)
    return _write(spec, servers, points)


def _write(spec: ServerProfileSpec, servers: list, points: list[dict[str, Any]]) -> tuple[dict[str, Any], SPSTable]:
    first = spec.context_lens[0]
    by_context = []
    for c in spec.context_lens:
        bt, sps = fit_points([p for p in points if p["context_len"] == c])
        by_context.append({"context_len": c, "batch_tokens": bt, "steps_per_sec": sps})
    main = by_context[0]
    meta = {"measures": "served-step", "target": servers[0].model,
            "servers": [s.describe() for s in servers], "context_len": first, "output_tokens": spec.output_tokens,
            "repeats": spec.repeats, "warmup": spec.warmup,
            "statistic": "per level the median over rounds of the median over requests of the mean gap between "
                         "chunks while every request decoded; batch tokens from the server's counters",
            "conditions": {"device": "server", "engine": servers[0].engine, "version": servers[0].version,
                           "server": shown(servers[0].url)},
            "points": points, **({"by_context": by_context} if len(by_context) > 1 else {}),
            "provenance": provenance(servers=[shown(s.url) for s in servers])}
    table = SPSTable(main["batch_tokens"], main["steps_per_sec"], meta=meta, mode="linear", extrapolate="linear")
    sg, png = _named(spec, spec.out)
    measured = [(round(p["batch_tokens"]), 1000.0 / p["step_ms"]) for p in points if p["context_len"] == first]
    measured.sort()
    with staged() as stage:
        plot_sps(table.batch_tokens, table.steps_per_sec, stage(png),
                 f"{servers[0].engine or 'server'} {servers[0].model}: served step, context {first}", as_path=png,
                 other=([b for b, _ in measured], [s for _, s in measured], "measured (median of rounds)"),
                 label="table (fitted)")
        save_sps_table(table, stage(sg), fmt="sglang")
        save_sps_table(table, stage(spec.out), fmt="dsparkctl")
    doc = {"table": str(spec.out), "sglang_table": str(sg), "plot": str(png), "measures": "served-step",
           "servers": meta["servers"], "batch_tokens": table.batch_tokens,
           "steps_per_sec": [round(s, 3) for s in table.steps_per_sec],
           "ms_per_step": [round(1000 / s, 3) for s in table.steps_per_sec], "points": points,
           "by_context": by_context, "warnings": []}
    return doc, table
