"""The SGLang files serve-config passes on: its SPS table and STS file, each checked as SGLang will
read it, and found beside our own table or calibration when the user names ours.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsparkctl.errors import InputError
from dsparkctl.formats.calibration import CALIBRATION_FORMAT, temperatures_of
from dsparkctl.formats.sps import SPS_FORMATS, load_sps_table, table_from_json
from dsparkctl.strict_json import read


def check_sglang_sps(path: Path) -> dict[str, Any]:
    """An SGLang SPS table SGLang will use: a valid table (increasing probes, finite positive
    rates, max_batch_tokens ≥ the last probe) with ≥ 2 probes (one probe = uninitialised)."""

    d = read(path, "SPS table", "write one with `dsparkctl profile-sps`")
    if not isinstance(d, dict) or "sample_batch_tokens" not in d or "sample_steps_per_sec" not in d:
        raise InputError(f"{path}: not an SGLang SPS table (sample_batch_tokens, sample_steps_per_sec)",
                         "pass the <out>.sglang.json that profile-sps writes")
    table_from_json(d, str(path))  # the same checks as every other reader: one-line InputError naming the file
    if len(d["sample_batch_tokens"]) < 2:
        raise InputError(f"{path}: one probe; SGLang treats it as uninitialised and verifies every draft",
                         "profile at least two batch-token counts")
    return d


def check_sts(path: Path, block_size: int) -> dict[str, Any]:
    """An SGLang STS file for this draft: γ positive temperatures (SGLang's planner checks γ)."""

    d = read(path, "STS file", "write one with `dsparkctl calibrate`")
    temps = temperatures_of(d, path)
    if len(temps) != block_size:
        raise InputError(f"{path}: {len(temps)} temperatures for a draft with block size {block_size}",
                         "calibrate traces of this draft")
    if "dataset" in d and not isinstance(d["dataset"], str):
        raise InputError(f"{path}: 'dataset' must be a string", "pass the .sglang-sts.json that calibrate writes")
    return d


def check_our_sps(path: Path) -> tuple[str | None, int | None]:
    """Our SPS table, read strictly and against its SGLang twin; returns the draft and the block
    size it was profiled with (None where it does not say).

    Only a whole-step table is accepted: a target-forward one leaves out the draft and the
    schedule, so it overstates steps/s and the planner would verify too much."""

    d = read(path, "SPS table", "write one with `dsparkctl profile-sps`")
    ours = table_from_json(d, str(path))  # strictly, like its SGLang twin
    twin = load_sps_table(twin_path(path))
    if (list(ours.batch_tokens), list(ours.steps_per_sec)) != (list(twin.batch_tokens), list(twin.steps_per_sec)):
        raise InputError(f"{path} and its SGLang twin {twin_path(path)} hold different tables",
                         "profile again; the two files are written together")
    measures, drafted = d.get("measures"), d.get("draft")
    if measures not in ("whole-step", "served-step"):  # older tables (no `measures`) timed the target's forward alone
        raise InputError(f"{path} does not time the whole speculative step (measures: {json.dumps(measures)}); "
                         "SGLang's planner needs whole-step costs (draft + schedule + verify)",
                         "profile with `dsparkctl profile-sps` (whole-step is the default) and the draft you serve")
    gamma = d.get("block_size")
    return (drafted if isinstance(drafted, str) and drafted else None,
            gamma if isinstance(gamma, int) and not isinstance(gamma, bool) else None)


def twin_path(path: Path) -> Path:
    return path.with_name(path.stem + ".sglang.json")


def sglang_file(path: Path, kind: str) -> Path:
    """Our SPS table / calibration result -> the SGLang file written beside it; SGLang's files as they are."""

    d = read(path, "SPS table" if kind == "sps" else "calibration file",
             "write it with `dsparkctl profile-sps`" if kind == "sps" else "write it with `dsparkctl calibrate`")
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object", "give the JSON file dsparkctl or SGLang wrote")
    if kind == "sps" and d.get("format") in SPS_FORMATS:
        twin = twin_path(path)
        if not twin.is_file():
            raise InputError(f"{path} is our SPS table and {twin} (its SGLang twin) is missing",
                             "pass the .sglang.json that profile-sps writes beside it")
        return twin
    if kind == "sts" and ("temperatures" not in d or d.get("format") == CALIBRATION_FORMAT):
        named = (d.get("outputs") or {}).get("sglang_sts") if isinstance(d.get("outputs"), dict) else None
        twin = None
        if isinstance(named, str) and named:  # beside the file first (a relative name is relative to where
            # calibrate ran, which may hold another calibration's twin), else as written
            twin = next((p for p in (path.parent / Path(named).name, Path(named)) if p.is_file()), None)
        if twin is None:
            raise InputError(f"{path}: not an SGLang STS file and names none that exists",
                             "pass the .sglang-sts.json that calibrate writes")
        return twin
    return path
