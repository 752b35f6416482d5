"""The parity verdict: does the draft behave in the engine as it did offline?

Offline is our own measurement of the same draft, target and sampling: an `eval-acceptance
--json` document (one dataset and draft of it, live rounds where present, else teacher-forced) or
a trace (`generate --trace`). Per position both conditional acceptances come with 95% intervals;
they agree where the intervals overlap (a bounded served conditional: where its widest interval
does). Where they disagree, the pattern orders the likely causes:

    accept length ≈ 1.0              speculation not running, or the method name wrong
    everything lower by one factor   temperature or sampling settings
    position 1 low                   chat template, tokenizer or vocabulary map (d2t)
    positions ≥ 2 fall off           the Markov head not applied (a DSpark draft served as
                                     DFlash) or another block size
    served higher                    other prompts than offline (easier traffic)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.formats.trace import TRACE_FORMAT
from dsparkctl.formats.trace_scan import Progress, scan_trace
from dsparkctl.math.stats import AcceptanceStats, mean_interval
from dsparkctl.strict_json import read

EVAL_FORMAT = "dsparkctl-eval-acceptance/1"
OFFLINE_HINT = "pass `dsparkctl eval-acceptance --json` output (or its --out file) or a `generate --trace` file"
CAUSES = {
    "not-running": "accept length ≈ 1.0: speculation is not running, or the method name is wrong (vLLM "
                   "method \"dspark\"; SGLang --speculative-algorithm DSPARK, not left at its default)",
    "sampling": "every position lower by a similar factor: the temperature or sampling settings differ from "
                "offline (check the requests' temperature, top_p, top_k)",
    "template": "position 1 low: what the draft is fed differs: the chat template, the tokenizer, the vocabulary map "
                "(a reduced draft's d2t) or the target's hidden states (other layers, or concatenated in another "
                "order)",
    "markov": "positions ≥ 2 fall off: the Markov head is not applied (the draft served as DFlash, or by an "
              "engine that ignores markov_*), or the engine runs another block size",
    "prompts": "served higher than offline: the served prompts are easier than the offline set, or offline "
               "measured another draft or temperature",
    "block-size": "the engine drafts {served} positions, offline measured {offline}: another block size",
}


def _pick(d: dict[str, Any], key: str | None, what: str, flag: str) -> tuple[str, Any]:
    if key is not None:
        if key not in d:
            raise UsageError(f"the offline document has no {what} {key!r} (it has {', '.join(map(repr, d))})",
                             f"pass one of those to {flag}")
        return key, d[key]
    if len(d) != 1:
        raise UsageError(f"the offline document holds {len(d)} {what}s ({', '.join(map(repr, d))})",
                         f"choose one with {flag}")
    return next(iter(d.items()))


def read_offline(path: Path, dataset: str | None = None, draft: str | None = None,
                 measure: str | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Our offline acceptance, as {label, measure, block_size, temperature, tau, tau_interval,
    conditional, conditional_interval}. `progress(done, total)` counts a trace's bytes read."""
    with open(path, "rb") as fh:
        head = fh.readline(65536)
    if b'"' + TRACE_FORMAT.encode() + b'"' in head:
        return _from_trace(path, progress)
    doc = read(path, "offline result", OFFLINE_HINT)
    if not isinstance(doc, dict) or doc.get("format") != EVAL_FORMAT or not isinstance(doc.get("datasets"), dict):
        raise InputError(f"{path} is neither an eval-acceptance document nor a trace", OFFLINE_HINT)
    ds_name, ds = _pick(doc["datasets"], dataset, "dataset", option("offline_dataset"))
    if not isinstance(ds, dict) or not isinstance(ds.get("drafts"), dict):
        raise InputError(f"{path}: dataset {ds_name!r} holds no drafts", OFFLINE_HINT)
    label, entry = _pick(ds["drafts"], draft, "draft", option("offline_draft"))
    if not isinstance(entry, dict):
        raise InputError(f"{path}: draft {label!r} is malformed", OFFLINE_HINT)
    measures = [m for m in ("live", "teacher_forced") if isinstance(entry.get(m), dict)]
    if measure is not None:
        key = measure.replace("-", "_")
        if key not in measures:
            raise UsageError(f"the offline document has no {measure} measurement for {label!r}",
                             f"it has {', '.join(m.replace('_', '-') for m in measures) or 'none'}")
        measures = [key]
    if not measures:
        raise InputError(f"{path}: draft {label!r} has no live or teacher-forced result", OFFLINE_HINT)
    m = entry[measures[0]]
    where = f"{path}: {ds_name}/{label} {measures[0].replace('_', '-')}"
    stats = _tf_stats(m, where) if measures[0] == "teacher_forced" else _live_stats(m, where, bool(doc.get("lookup")))
    if entry.get("block_size") is not None and entry.get("block_size") != m.get("block_size"):
        raise InputError(f"{where}: the draft's block size {entry.get('block_size')!r} and the measurement's "
                         f"{m.get('block_size')!r} contradict each other", "rerun eval-acceptance")
    if not any(c is not None for c in stats["conditional"]):
        raise InputError(f"{where} measured nothing (no round or anchor reached position 1)",
                         "rerun eval-acceptance with more prompts or tokens")
    return {"source": str(path), "dataset": ds_name, "label": label, "measure": measures[0].replace("_", "-"),
            "block_size": entry.get("block_size"), "temperature": doc.get("temperature"), **stats}


def _live_stats(m: dict[str, Any], where: str, lookup: bool) -> dict[str, Any]:
    """The draft's own live figures. A document measured with context lookup before the draft's
    rounds were kept apart (no `lookup` entry beside them) pools the copies in: refused."""
    if lookup and not isinstance(m.get("lookup"), dict):
        raise InputError(f"{where} pools the draft's rounds with context lookup's copies (written before they were "
                         "kept apart), so it cannot be compared with an engine's draft",
                         "use --offline-measure teacher-forced, or rerun eval-acceptance")
    try:
        s = AcceptanceStats.from_json(m)
    except (ValueError, TypeError, KeyError) as exc:
        raise InputError(f"{where}: {exc}", OFFLINE_HINT) from None
    out = _stats_fields(s)
    ci = m.get("conditional_interval")
    if m.get("interval_unit") == "prompt" and isinstance(ci, list) and len(ci) == s.block_size and all(
            x is None or (isinstance(x, list) and len(x) == 2 and all(map(_unit, x)) and x[0] <= x[1]) for x in ci):
        out["conditional_interval"] = ci  # over prompts: the rounds of one prompt are not independent
    return out


def _unit(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0


def _tf_stats(m: dict[str, Any], where: str) -> dict[str, Any]:
    """The draft's own teacher-forced figures, checked (a damaged document is named, not compared).
    A document from before the draft's figures went to the top keeps them in `lookup.draft_alone`."""
    look = m.get("lookup")
    if isinstance(look, dict) and isinstance(look.get("draft_alone"), dict):
        m = look["draft_alone"]
    g = m.get("block_size")
    cond, ci, tau, tci = m.get("conditional"), m.get("conditional_interval"), m.get("tau"), m.get("tau_interval")
    ok = (isinstance(g, int) and not isinstance(g, bool) and g >= 1 and isinstance(cond, list) and len(cond) == g
          and isinstance(ci, list) and len(ci) == g
          and all(c is None or _unit(c) for c in cond)
          and all((x is None and c is None) or (isinstance(x, list) and len(x) == 2 and all(map(_unit, x))
                                               and x[0] <= x[1]) for c, x in zip(cond, ci))
          and (tau is None or (isinstance(tau, (int, float)) and not isinstance(tau, bool) and 1.0 <= tau <= g + 1))
          and (tci is None or (isinstance(tci, list) and len(tci) == 2
                               and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in tci))))
    if not ok:
        raise InputError(f"{where} is damaged: block_size, conditional (γ values in [0, 1] or null), their "
                         "intervals and τ (in [1, γ+1]) do not hold together", "rerun eval-acceptance")
    return {"tau": tau, "tau_interval": tci, "conditional": cond, "conditional_interval": ci}


def _stats_fields(s: AcceptanceStats) -> dict[str, Any]:
    ci = mean_interval(s.histogram)
    return {"tau": s.tau, "tau_interval": list(ci) if ci else None, "conditional": s.conditional(),
            "conditional_interval": [list(x) if x else None for x in s.conditional_interval()], "rounds": s.rounds}


def _from_trace(path: Path, progress: Progress | None = None) -> dict[str, Any]:
    """The acceptance of a trace's drafted rounds, streamed (`scan_trace`: columns, no logits kept)."""
    size = path.stat().st_size
    t = scan_trace(path, (lambda n: progress(n, size)) if progress else None, keep_logits=False)
    drafted = t.drafted
    if not drafted.any():
        raise InputError(f"{path}: the trace has no drafted rounds", "record one with `dsparkctl generate --trace`")
    gamma = t.block_size[drafted]
    if (other := np.flatnonzero(gamma != gamma[0])).size:
        raise InputError(f"{path}: block size {int(gamma[other[0]])} differs from {int(gamma[0])} in earlier rounds",
                         "compare a trace of one block size")
    s = AcceptanceStats(block_size=int(gamma[0]))
    s.add_rounds(t.verify_length[drafted].astype(np.int64), t.accepted[drafted].astype(np.int64))
    return {"source": str(path), "dataset": t.header.get("dataset"), "label": t.header.get("draft"),
            "measure": "live (trace)", "block_size": s.block_size, "temperature": t.header.get("temperature"),
            **_stats_fields(s)}


def _overlap(a, b) -> bool | None:
    if not a or not b or a[0] is None or b[0] is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def parity(served: dict[str, Any], offline: dict[str, Any]) -> dict[str, Any]:
    """Per position: offline, served, whether their intervals agree; then the verdict and its causes."""
    rows = []
    for p in served["per_position"]:
        k = p["position"]
        if k > len(offline["conditional"]):
            break
        off_c, off_ci = offline["conditional"][k - 1], offline["conditional_interval"][k - 1]
        agree = _overlap(off_ci, p["conditional_interval"])
        srv_mid = (p["conditional"] if p["conditional"] is not None else
                   (sum(p["conditional_bounds"]) / 2 if p["conditional_bounds"] else None))
        side = None
        if agree is False:
            side = "lower" if p["conditional_interval"][1] < off_ci[0] else "higher"
        rows.append({"position": k, "offline": off_c, "offline_interval": off_ci, "served": p["conditional"],
                     "served_bounds": p["conditional_bounds"], "served_interval": p["conditional_interval"],
                     "served_identified": p["identified"], "agree": agree, "side": side,
                     "ratio": (srv_mid / off_c) if srv_mid is not None and off_c else None})
    tau_agree = _overlap(offline.get("tau_interval"), served.get("tau_interval"))
    causes = _causes(served, offline, rows)
    disagree = [r["position"] for r in rows if r["agree"] is False]
    served_k, off_k = served.get("positions"), offline.get("block_size")
    other_size = bool(served_k and off_k and served_k != off_k)  # positions past the shorter side go unchecked
    unchecked = [r["position"] for r in rows if r["agree"] is None]  # a side without an interval there
    verdict = ("not-running" if causes and causes[0] == "not-running" else
               "disagree" if disagree or other_size else "no-positions" if not rows or len(unchecked) == len(rows)
               else "partial" if unchecked else "agree")
    return {"offline": {k: offline[k] for k in ("source", "dataset", "label", "measure", "block_size", "temperature",
                                                "tau", "tau_interval")},
            "served_tau": served["tau"], "served_tau_interval": served["tau_interval"], "tau_agree": tau_agree,
            "positions": rows, "disagreeing_positions": disagree, "unchecked_positions": unchecked, "verdict": verdict,
            "causes": [{"cause": c, "text": CAUSES[c].format(served=served["positions"],
                                                             offline=offline["block_size"])} for c in causes]}


def _causes(served: dict[str, Any], offline: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The likely causes, most likely first (empty when everything agrees)."""
    out: list[str] = []
    tau, off_tau = served.get("tau"), offline.get("tau")
    if tau is not None and tau < 1.05 and off_tau is not None and off_tau > 1.15:
        out.append("not-running")
    lower = [r for r in rows if r["side"] == "lower"]
    higher = [r for r in rows if r["side"] == "higher"]
    first_low = any(r["position"] == 1 for r in lower)
    later_low = [r for r in lower if r["position"] >= 2]
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    r1 = next((r["ratio"] for r in rows if r["position"] == 1), None)
    # the most a later position can have kept (a bounded served value at its upper bound)
    later_kept = [r["served_bounds"][1] / r["offline"] for r in later_low if r["served_bounds"] and r["offline"]]
    falloff = bool(later_low) and (not first_low or (r1 is not None and later_kept
                                                     and max(later_kept) < 0.6 * r1))
    uniform = (first_low and len(rows) >= 2 and not higher and len(ratios) == len(rows) and max(ratios) < 1
               and max(ratios) <= 1.5 * min(ratios) and len(lower) >= max(2, len(rows) // 2))
    if falloff:
        out += ["markov"] + (["template"] if first_low else []) + ["sampling"]
    elif uniform:
        out += ["sampling", "template"]
    elif first_low:
        out += ["template", "sampling"] + (["markov"] if later_low else [])
    served_k, off_k = served.get("positions"), offline.get("block_size")
    if served_k and off_k and served_k != off_k:
        out.insert(1 if out and out[0] == "not-running" else 0, "block-size")
    if higher and not lower:
        out.append("prompts")
    return list(dict.fromkeys(out))
