"""Prometheus scrapes of vLLM's and SGLang's /metrics, read into `ServedCounts` (formats/served.py
says what each counter is). Parsed with prometheus_client's own parser, never by hand."""

from __future__ import annotations

import math
from typing import Any

from dsparkctl.errors import InputError
from dsparkctl.formats.served import (MAX_POSITIONS, SCRAPE_HINT, SGLANG_GAUGES, VLLM, VLLM_COUNTERS, VLLM_PER_POS,
                                      ServedCounts, _count)


def parse_scrape(text: str, where: str, model: str | None = None) -> ServedCounts:
    """One scrape (Prometheus text exposition) of vLLM's or SGLang's /metrics, parsed with
    prometheus_client's parser; the counters' totals since the server started."""
    return _speculative_counts(_samples(text, where), where, model)


def _speculative_counts(series, where: str, model: str | None) -> ServedCounts:
    names = {name for name, _ in series}
    if not any(n.startswith(VLLM) for n in names):
        gauges = [n for n in SGLANG_GAUGES if n in names]
        if gauges:
            return _sglang_gauges(series, where, model)
        engine = ("vLLM" if any(n.startswith("vllm:") for n in names)
                  else "SGLang" if any(n.startswith("sglang:") for n in names) else None)
        raise InputError(f"{where}: the scrape holds no speculative-decoding metrics"
                         + (f" ({engine}'s other metrics are there: the server runs without speculation)" if engine
                            else " (neither vLLM's nor SGLang's)"),
                         "scrape a server started with speculative decoding (vLLM --speculative-config, SGLang "
                         "--speculative-algorithm)" if engine else SCRAPE_HINT)
    return _vllm_counts(series, where, model)


def _samples(text: str, where: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key in out:
                    raise InputError(f"{where}: sample {s.name} with labels {dict(key[1])} appears twice",
                                     "pass a single scrape per file")
                out[key] = s.value
    except InputError:
        raise
    except Exception as exc:  # the parser raises ValueError/TypeError/IndexError on malformed lines
        raise InputError(f"{where}: not Prometheus text exposition ({type(exc).__name__}: {str(exc)[:80]})",
                         SCRAPE_HINT) from None
    if not out:
        raise InputError(f"{where}: the scrape is empty", SCRAPE_HINT)
    return out


def _models(series, prefix: str) -> list[str]:
    return sorted({dict(lab).get("model_name", "") for name, lab in series if name.startswith(prefix)})


def _pick_model(series, prefix: str, where: str, model: str | None) -> str | None:
    models = _models(series, prefix)
    if model is not None:
        if model not in models:
            raise InputError(f"{where}: no speculative metrics for model {model!r} (the scrape has "
                             f"{', '.join(map(repr, models))})", "pass one of those to --model")
        return model
    if len(models) > 1:
        raise InputError(f"{where}: the scrape holds {len(models)} models ({', '.join(map(repr, models))})",
                         "choose one with --model")
    return models[0] or None


def _positions(series, chosen: str | None, where: str) -> int:
    """K, from the position labels of vLLM's per-position series: 0, 1, ..., K-1, each once."""
    positions = sorted({dict(lab).get("position") for n, lab in series
                        if n in (VLLM_PER_POS + "_total", VLLM_PER_POS)
                        and dict(lab).get("model_name", "") == (chosen or "")}, key=lambda p: (len(p or ""), p))
    if not positions:
        raise InputError(f"{where}: {VLLM_PER_POS}_total is missing (vLLM exports it whenever it speculates: the "
                         "scrape is partial or filtered)", "pass the whole /metrics page, as curl saves it")
    try:
        idx = [int(p) for p in positions]
    except (TypeError, ValueError):
        raise InputError(f"{where}: {VLLM_PER_POS} has position labels {positions[:5]}, not 0, 1, 2, ...",
                         "pass a scrape of vLLM's /metrics") from None
    if len(set(idx)) != len(idx):
        twice = sorted({i for i in idx if idx.count(i) > 1})
        raise InputError(f"{where}: {VLLM_PER_POS} names position {twice[0]} twice "
                         f"({', '.join(repr(p) for p in positions if int(p) == twice[0])})",
                         "pass a scrape of one vLLM server; it labels positions 0, 1, 2, ...")
    if sorted(idx) != list(range(len(idx))):
        missing = sorted(set(range(max(idx) + 1)) - set(idx))
        raise InputError(f"{where}: {VLLM_PER_POS} has gaps: positions {sorted(idx)} (missing "
                         f"{missing[:8]})", "pass a complete scrape; vLLM exports positions 0..K-1")
    if len(idx) > MAX_POSITIONS:
        raise InputError(f"{where}: {len(idx)} draft positions (more than {MAX_POSITIONS})", "pass a vLLM scrape")
    return len(idx)


def _vllm_counts(series, where: str, model: str | None) -> ServedCounts:
    chosen = _pick_model(series, VLLM, where, model)

    def total(name: str, extra: dict[str, str] | None = None, *, created: bool = False) -> dict[str, float]:
        """Per series (its labels but the model and position: the engine, and any a federating scraper
        adds, such as instance): the counter's value (its `_total` sample) or its creation time."""
        vals: dict[str, float] = {}
        for (n, lab), v in series.items():
            d = dict(lab)
            if (n != name + ("_created" if created else "_total") and (created or n != name)) or \
                    d.get("model_name", "") != (chosen or ""):
                continue
            if any(d.get(k) != x for k, x in (extra or {}).items()):
                continue
            key = ",".join(f"{k}={x}" for k, x in sorted(d.items()) if k not in ("model_name", "position"))
            vals[key] = vals.get(key, 0.0) + v  # a bare name beside its `_total` is refused by the identities
        return vals

    counts: dict[str, int] = {}
    for key, name in VLLM_COUNTERS.items():
        per_engine = total(name)
        if not per_engine:
            raise InputError(f"{where}: {name}_total is missing", "pass a complete scrape of vLLM's /metrics")
        counts[key] = sum(_count(v, f"{name}_total", where) for v in per_engine.values())
    K = _positions(series, chosen, where)
    accepted_at = []
    for p in range(K):
        per_engine = total(VLLM_PER_POS, {"position": str(p)})
        accepted_at.append(sum(_count(v, f"{VLLM_PER_POS}_total{{position=\"{p}\"}}", where)
                               for v in per_engine.values()))
    c = ServedCounts(engine="vllm", kind="prometheus", positions=K, drafts=counts["drafts"],
                     draft_tokens=counts["draft_tokens"], accepted_tokens=counts["accepted_tokens"],
                     accepted_at=accepted_at, model=chosen)
    c.histogram = [counts["drafts"] - accepted_at[0], *(accepted_at[k] - accepted_at[k + 1] for k in range(K - 1)),
                   accepted_at[-1]]
    c.length_at_least = [counts["drafts"]] + [None] * (K - 1)  # every counted step drafted ≥ 1 token
    c.created = {name: total(name, created=True) for name in (*VLLM_COUNTERS.values(), VLLM_PER_POS)}
    start = [v for (n, _), v in series.items() if n == "process_start_time_seconds"]
    if len(start) == 1:  # prometheus_client's process collector (absent in its multiprocess mode)
        c.created["process_start_time_seconds"] = {"": start[0]}
    return c


def _sglang_gauges(series, where: str, model: str | None) -> ServedCounts:
    chosen = _pick_model(series, "sglang:spec_", where, model)
    vals = [v for (n, lab), v in series.items() if n == "sglang:spec_accept_length"
            and dict(lab).get("model_name", "") == (chosen or "")]
    if not vals:
        raise InputError(f"{where}: sglang:spec_accept_length is missing", "pass a scrape of SGLang's /metrics")
    for v in vals:
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise InputError(f"{where}: sglang:spec_accept_length is {v!r}", "take a fresh scrape")
    return ServedCounts(engine="sglang", kind="gauges", model=chosen, gauge_tau=sum(vals) / len(vals), notes=[
        "SGLang's /metrics publishes gauges (the mean of its last logging interval), not counts: τ only, "
        "without an interval; for per-position acceptance save its responses' meta_info"])


def scrape_window(earlier: ServedCounts, later: ServedCounts, where: str) -> ServedCounts:
    """The steps between two scrapes of one vLLM server (earlier first)."""
    if earlier.kind == "gauges" or later.kind == "gauges":
        raise InputError(f"{where}: SGLang's gauges cannot be differenced", "pass one SGLang scrape, or its responses")
    if (earlier.positions, earlier.model, earlier.accepted_at is None) != \
            (later.positions, later.model, later.accepted_at is None):
        raise InputError(f"{where}: the two scrapes describe different servers (positions {earlier.positions} vs "
                         f"{later.positions}, model {earlier.model!r} vs {later.model!r})",
                         "pass two scrapes of one server, earlier first")
    restarted = [n for n, per in later.created.items() for eng, t in per.items()
                 if eng in earlier.created.get(n, {}) and earlier.created[n][eng] != t]
    pairs = [("drafts", earlier.drafts, later.drafts), ("accepted tokens", earlier.accepted_tokens,
                                                         later.accepted_tokens)]
    if earlier.draft_tokens is not None and later.draft_tokens is not None:
        pairs.append(("draft tokens", earlier.draft_tokens, later.draft_tokens))
    for k, (a, b) in enumerate(zip(earlier.accepted_at or [], later.accepted_at or [])):
        pairs.append((f"accepted at position {k + 1}", a, b))
    back = [(n, a, b) for n, a, b in pairs if b < a]
    if restarted or back:
        what = (f"{back[0][0]} went from {back[0][1]} to {back[0][2]}" if back
                else f"{restarted[0]} was created anew")
        raise InputError(f"{where}: the counters went backwards between the scrapes ({what}): the server restarted "
                         "in between, or the scrapes are in the wrong order", "pass two scrapes of one server run, "
                         "earlier first (or one scrape: the totals since it started)")
    blind = not any(per for per in earlier.created.values()) or not any(per for per in later.created.values())
    diff = ServedCounts(engine="vllm", kind="prometheus-window", positions=later.positions,
                        drafts=later.drafts - earlier.drafts,
                        draft_tokens=(later.draft_tokens - earlier.draft_tokens
                                      if later.draft_tokens is not None and earlier.draft_tokens is not None else None),
                        accepted_tokens=later.accepted_tokens - earlier.accepted_tokens, model=later.model,
                        notes=list(later.notes))
    if blind:
        diff.notes.append("a scrape carries no creation times (no `_created` series nor process_start_time_seconds: "
                          "prometheus_client's multiprocess mode, or created series disabled), so a server restart "
                          "between the scrapes is caught only where the counts contradict each other")
    if later.accepted_at is not None and earlier.accepted_at is not None:
        diff.accepted_at = [b - a for a, b in zip(earlier.accepted_at, later.accepted_at)]
        K, D = diff.positions, diff.drafts
        acc = diff.accepted_at
        diff.histogram = [D - acc[0], *(acc[k] - acc[k + 1] for k in range(K - 1)), acc[-1]]
        diff.length_at_least = [D] + [None] * (K - 1)
    return diff


def engine_totals(text: str, where: str, model: str | None = None) -> dict[str, Any]:
    """What a scrape says about the engine beyond speculation: which engine ("vllm", "sglang" or
    None), its generation-token total (vLLM's `vllm:generation_tokens`, summed over the series of
    `model` or of every model), and its speculative counts (None: the server runs without them)."""
    series = _samples(text, where)
    names = {name for name, _ in series}
    engine = "vllm" if any(n.startswith("vllm:") for n in names) else (
        "sglang" if any(n.startswith("sglang:") for n in names) else None)
    generated = [v for (n, labels), v in series.items() if n == "vllm:generation_tokens_total"
                 and (model is None or dict(labels).get("model_name", model) == model)]
    if not all(math.isfinite(v) and v >= 0 for v in generated):
        raise InputError(f"{where}: vllm:generation_tokens is not a finite count", SCRAPE_HINT)
    try:
        counts = _speculative_counts(series, where, model)  # the text parsed once
    except InputError:
        if any(n.startswith(VLLM) for n in names):
            raise
        counts = None
    return {"engine": engine, "generation_tokens": int(sum(generated)) if generated else None, "spec": counts}
