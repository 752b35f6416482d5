"""SPS table files: ours (with provenance) and SGLang's, read strictly and written atomically.

    ours    {"format": "dsparkctl-sps/1", "batch_tokens": [...], "steps_per_sec": [...],
             "max_batch_tokens": N, "lookup": "floor", "extrapolate": "clamp",
             "provenance": {...}, ...extra keys preserved in `SPSTable.meta`}
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
from dsparkctl.fsutil import write_json
from dsparkctl.math.sps import EXTRAPOLATION, LOOKUP_MODES, SPSTable
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import read

SPS_FORMAT = "dsparkctl-sps/1"
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
    prov = meta.pop("provenance", None) or provenance()
    return {"format": SPS_FORMAT, "batch_tokens": list(table.batch_tokens),
            "steps_per_sec": list(table.steps_per_sec),
            "max_batch_tokens": int(table.max_batch_tokens), "lookup": table.mode,
            "extrapolate": table.extrapolate, **meta, "provenance": prov}


def save_sps_table(table: SPSTable, path: str | os.PathLike, fmt: str = "dsparkctl") -> None:
    """Write atomically, in our format (with provenance) or SGLang's."""
    write_json(path, table_json(table, fmt))


def table_from_json(obj: Any, source: str = "SPS table", mode: str | None = None,
                    extrapolate: str | None = None) -> SPSTable:
    """A table from a parsed file of either format; `mode`/`extrapolate` override the file's."""
    if not isinstance(obj, dict):
        raise InputError(f"{source}: expected a JSON object", "pass an SPS table JSON file")
    if obj.get("format") == SPS_FORMAT:
        known = {"format", "batch_tokens", "steps_per_sec", "max_batch_tokens", "lookup", "extrapolate"}
        for k in ("batch_tokens", "steps_per_sec"):
            if not isinstance(obj.get(k), list):
                raise InputError(f"{source}: field {k!r} missing or not a list", _WRITTEN_BY)
        for k, choices in (("lookup", LOOKUP_MODES), ("extrapolate", EXTRAPOLATION)):
            if k in obj and obj[k] not in choices:
                raise InputError(f"{source}: field {k!r} is {obj[k]!r}, not one of {', '.join(choices)}",
                                 f"set \"{k}\": \"{choices[0]}\"")
        return SPSTable(obj["batch_tokens"], obj["steps_per_sec"],
                        meta={k: v for k, v in obj.items() if k not in known},
                        mode=mode or obj.get("lookup", "floor"),
                        extrapolate=extrapolate or obj.get("extrapolate", "clamp"),
                        max_batch_tokens=obj.get("max_batch_tokens"), source=source)
    if "sample_batch_tokens" in obj or "sample_steps_per_sec" in obj:
        for k in ("sample_batch_tokens", "sample_steps_per_sec"):
            if not isinstance(obj.get(k), list):
                raise InputError(f"{source}: SGLang field {k!r} missing or not a list",
                                 "an SGLang table has sample_batch_tokens and sample_steps_per_sec")
        return SPSTable(obj["sample_batch_tokens"], obj["sample_steps_per_sec"],
                        meta={"imported_from": "sglang"}, mode=mode or "floor",
                        extrapolate=extrapolate or "clamp", max_batch_tokens=obj.get("max_batch_tokens"),
                        source=source)
    if "bias_seconds" in obj:
        raise InputError(f"{source}: SGLang additive step-time tables are not supported",
                         "profile a plain SPS table (sample_batch_tokens / sample_steps_per_sec)")
    raise InputError(f"{source}: not an SPS table (no 'format': '{SPS_FORMAT}' and no "
                     "'sample_batch_tokens')", _WRITTEN_BY)


def load_sps_table(path: str | os.PathLike, mode: str | None = None, extrapolate: str | None = None) -> SPSTable:
    """Read our JSON or SGLang's (auto-detected). Errors name the file."""
    obj = read(path, "SPS table", "profile one with `dsparkctl profile-sps`")
    return table_from_json(obj, source=str(path), mode=mode, extrapolate=extrapolate)
