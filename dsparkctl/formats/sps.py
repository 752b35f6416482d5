"""SPS table files: ours (with provenance) and SGLang's, read strictly and written atomically.

    ours    {"format": "dsparkctl-sps/2", "batch_tokens": [...], "steps_per_sec": [...],
             "max_batch_tokens": N, "lookup": "floor", "extrapolate": "clamp",
             "grid": {"requests", "tokens_per_request", "step_ms", "plain_ms", "verify"} (math.sps.StepGrid;
                      "verify" absent = "padded", how every grid table so far was measured),
             "conditions": {machine, threads, kernels, ...}, "points": raw probes,
             "provenance": {...}, ...extra keys preserved in `SPSTable.meta`}
            Format 1 (no grid, so no plain step) is still read.
    SGLang  {"sample_batch_tokens": [...], "sample_steps_per_sec": [...], "max_batch_tokens": N}
            (`--speculative-dspark-sps-table-path`; sglang dspark_components/dspark_sps.py
            requires max_batch_tokens ≥ the last probe.)

`load_sps_table` detects the format from the keys and reads strict JSON (no NaN/Infinity, each
key once); the table itself (validation, lookup) is `dsparkctl.math.sps.SPSTable`.
"""

from __future__ import annotations

import os
from typing import Any

from dsparkctl.errors import InputError, UsageError
from dsparkctl.files.atomic import write_json
from dsparkctl.math.sps import EXTRAPOLATION, LOOKUP_MODES, SPSTable, StepGrid
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import read

SPS_FORMAT = "dsparkctl-sps/2"
SPS_FORMATS = ("dsparkctl-sps/1", SPS_FORMAT)
FORMATS = ("dsparkctl", "sglang")
_WRITTEN_BY = "pass a file written by `dsparkctl profile-sps`"


def table_json(table: SPSTable, fmt: str = "dsparkctl") -> dict[str, Any]:
    """The file content of `table` in our format (with provenance) or SGLang's."""
    if fmt == "sglang":
        return {"sample_batch_tokens": list(table.batch_tokens),
                "sample_steps_per_sec": list(table.steps_per_sec),
                "max_batch_tokens": int(table.max_batch_tokens)}
    if fmt != "dsparkctl":
        raise UsageError(f"unknown SPS table format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    meta = dict(table.meta)
    meta.pop("grid", None)
    prov = meta.pop("provenance", None) or provenance()
    return {"format": SPS_FORMAT if table.grid else SPS_FORMATS[0], "batch_tokens": list(table.batch_tokens),
            "steps_per_sec": list(table.steps_per_sec),
            "max_batch_tokens": int(table.max_batch_tokens), "lookup": table.mode,
            "extrapolate": table.extrapolate, **({"grid": table.grid.to_json()} if table.grid else {}),
            **meta, "provenance": prov}


def save_sps_table(table: SPSTable, path: str | os.PathLike, fmt: str = "dsparkctl") -> None:
    """Write atomically, in our format (with provenance) or SGLang's."""
    write_json(path, table_json(table, fmt))


def table_from_json(obj: Any, source: str = "SPS table", mode: str | None = None,
                    extrapolate: str | None = None) -> SPSTable:
    """A table from a parsed file of either format; `mode`/`extrapolate` override the file's."""
    if not isinstance(obj, dict):
        raise InputError(f"{source}: expected a JSON object", "pass an SPS table JSON file")
    if obj.get("format") in SPS_FORMATS:
        known = {"format", "batch_tokens", "steps_per_sec", "max_batch_tokens", "lookup", "extrapolate", "grid"}
        for k in ("batch_tokens", "steps_per_sec"):
            if not isinstance(obj.get(k), list):
                raise InputError(f"{source}: field {k!r} missing or not a list", _WRITTEN_BY)
        for k, choices in (("lookup", LOOKUP_MODES), ("extrapolate", EXTRAPOLATION)):
            if k in obj and obj[k] not in choices:
                raise InputError(f"{source}: field {k!r} is {obj[k]!r}, not one of {', '.join(choices)}",
                                 f"set \"{k}\": \"{choices[0]}\"")
        grid = _grid(obj, source) if obj["format"] == SPS_FORMAT else None
        table = SPSTable(obj["batch_tokens"], obj["steps_per_sec"],
                         meta={k: v for k, v in obj.items() if k not in known},
                         mode=mode or obj.get("lookup", "floor"),
                         extrapolate=extrapolate or obj.get("extrapolate", "clamp"),
                         max_batch_tokens=obj.get("max_batch_tokens"), source=source, grid=grid)
        check_monotone(table)
        return table
    if "sample_batch_tokens" in obj or "sample_steps_per_sec" in obj:
        for k in ("sample_batch_tokens", "sample_steps_per_sec"):
            if not isinstance(obj.get(k), list):
                raise InputError(f"{source}: SGLang field {k!r} missing or not a list",
                                 "an SGLang table has sample_batch_tokens and sample_steps_per_sec")
        table = SPSTable(obj["sample_batch_tokens"], obj["sample_steps_per_sec"],
                         meta={"imported_from": "sglang"}, mode=mode or "floor",
                         extrapolate=extrapolate or "clamp", max_batch_tokens=obj.get("max_batch_tokens"),
                         source=source)
        check_monotone(table)
        return table
    if "bias_seconds" in obj:
        raise InputError(f"{source}: SGLang additive step-time tables are not supported",
                         "profile a plain SPS table (sample_batch_tokens / sample_steps_per_sec)")
    raise InputError(f"{source}: not an SPS table (no 'format': '{SPS_FORMAT}' and no "
                     "'sample_batch_tokens')", _WRITTEN_BY)


def _grid(obj: dict[str, Any], source: str) -> StepGrid:
    g = obj.get("grid")
    if not isinstance(g, dict) or not all(k in g for k in ("requests", "tokens_per_request", "step_ms")):
        raise InputError(f"{source}: a {SPS_FORMAT} table needs a 'grid' with requests, tokens_per_request "
                         "and step_ms", _WRITTEN_BY)
    return StepGrid(g["requests"], g["tokens_per_request"], g["step_ms"], g.get("plain_ms"), source=source,
                    verify=g.get("verify", "padded"))


def check_monotone(table: SPSTable) -> None:
    """Refuse a table whose steps/s RISE with batch tokens: more work cannot take less time, and a
    planner reading such a table chases noise (it verifies more to land on the faster probe)."""
    s = table.steps_per_sec
    for i in range(1, len(s)):
        if s[i] > s[i - 1] * (1 + 1e-9):
            raise InputError(f"{table.source}: steps/s rises from {s[i - 1]:.4g} at {table.batch_tokens[i - 1]} "
                             f"batch tokens to {s[i]:.4g} at {table.batch_tokens[i]} (not monotone: a noisy or "
                             "hand-edited table)",
                             "profile again with `dsparkctl profile-sps`, which fits a monotone table")


def condition_notes(table: SPSTable, now: dict[str, Any] | None, target: str | None = None,
                    block_size: int | None = None) -> list[str]:
    """What differs between the conditions a table was profiled under and `now` (a session's
    `conditions()`; None: only the table's own facts are checked): one note per difference."""
    meta, notes = table.meta, []
    had = meta.get("conditions") if isinstance(meta.get("conditions"), dict) else None
    if had is None:
        notes.append(f"{table.source} does not say what machine, threads and kernels it was profiled with "
                     "(an older or imported table); its step times may not be this run's")
    elif now is not None:
        for k in ("cpu", "machine", "threads", "cpu_kernels", "draft_weights", "device", "dtype", "torch"):
            if k in had and k in now and had[k] != now[k]:
                notes.append(f"{table.source} was profiled with {k} {had[k]!r}, this run has {now[k]!r}: "
                             "its step times may not hold here")
    if target is not None and isinstance(meta.get("target"), str) and meta["target"] != target:
        notes.append(f"{table.source} was profiled on target {meta['target']!r}, this run uses {target!r}")
    return notes


def table_for_context(table: SPSTable, context_len: int) -> SPSTable:
    """The table of one context length from a server-measured table's `by_context` (the table itself
    when it holds one context); refused for a context it did not measure."""
    entries = table.meta.get("by_context")
    if not isinstance(entries, list):
        if table.meta.get("context_len") in (None, context_len):
            return table
        raise InputError(f"{table.source} was measured at context {table.meta.get('context_len')}, not {context_len}",
                         "profile that context: `dsparkctl profile-sps --server URL --context-len ...`")
    for e in entries:
        if isinstance(e, dict) and e.get("context_len") == context_len:
            return SPSTable(e.get("batch_tokens") or [], e.get("steps_per_sec") or [],
                            meta={**table.meta, "context_len": context_len}, mode=table.mode,
                            extrapolate=table.extrapolate, source=f"{table.source} (context {context_len})")
    raise InputError(f"{table.source} holds no table for context {context_len}",
                     f"use one of its contexts: {', '.join(str(e.get('context_len')) for e in entries if isinstance(e, dict))}")


def cost_source(table: SPSTable, path: str | os.PathLike) -> dict[str, Any]:
    """Where a table's step costs come from, as a planner's notes name it: a running server
    (`profile-sps --server`: engine, version, server, model), dsparkctl's own engine, or an
    imported SGLang table."""
    meta = table.meta
    if meta.get("measures") == "served-step" and isinstance(meta.get("servers"), list) and meta["servers"]:
        first = meta["servers"][0] if isinstance(meta["servers"][0], dict) else {}
        return {"kind": "server", "file": str(path), "engine": first.get("engine"), "version": first.get("version"),
                "server": first.get("server"), "model": first.get("model"), "servers": len(meta["servers"])}
    if meta.get("imported_from") == "sglang":
        return {"kind": "sglang-table", "file": str(path)}
    return {"kind": "dsparkctl-engine", "file": str(path), "measures": meta.get("measures"),
            "device": (meta.get("conditions") or {}).get("device") if isinstance(meta.get("conditions"), dict) else None}


def cost_note(source: dict[str, Any]) -> str:
    """One line naming a plan's step costs (`cost_source`)."""
    if source.get("kind") == "server":
        more = f" and {source['servers'] - 1} more server(s)" if source.get("servers", 1) > 1 else ""
        return (f"step costs measured on the running server {source.get('server')}{more} ({source.get('engine')} "
                f"{source.get('version')}, model {source.get('model')}; profile-sps --server, {source.get('file')})")
    if source.get("kind") == "sglang-table":
        return f"step costs from an SGLang table ({source.get('file')}; how it was measured is not recorded)"
    how = ", ".join(str(x) for x in (source.get("measures"), source.get("device"), source.get("file")) if x)
    return (f"step costs measured on dsparkctl's own engine ({how}), not on the server: "
            "`dsparkctl profile-sps --server URL` measures the server's")


def check_block_size(table: SPSTable, block_size: int) -> None:
    """Refuse a whole-step table profiled with a draft of another block size: its steps priced
    drafts this draft does not make (and its grid may verify more than γ)."""
    had = table.meta.get("block_size")
    if isinstance(had, int) and not isinstance(had, bool) and had != block_size:
        raise InputError(f"{table.source} was profiled with a draft of block size {had}; this draft's is {block_size}",
                         "profile again with this draft: `dsparkctl profile-sps --draft ...`")


def load_sps_table(path: str | os.PathLike, mode: str | None = None, extrapolate: str | None = None) -> SPSTable:
    """Read our JSON or SGLang's (auto-detected). Errors name the file."""
    obj = read(path, "SPS table", "profile one with `dsparkctl profile-sps`")
    return table_from_json(obj, source=str(path), mode=mode, extrapolate=extrapolate)
