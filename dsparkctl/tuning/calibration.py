"""STS calibration from recorded rounds: traces and SGLang shards pooled, split by request, fitted
(math/calibration.py) and measured before and after on the held-out part; and how well a draft's
confidence head predicted a run's outcomes (`confidence_report`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.formats.calibration import CALIBRATION_FORMAT, load_temperatures, read_sglang_shard
from dsparkctl.formats.trace import describe_rounds, recording_fix
from dsparkctl.formats.trace_scan import Progress, RoundTable, read_round_table
from dsparkctl.math.calibration import MIN_FIT_TRIALS, CalibrationData, fit_sts, position_metrics, split_requests
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import finite


def calibration_data(table: RoundTable) -> tuple[CalibrationData, torch.Tensor]:
    """All drafted rounds of a pooled table as tensors, plus a request key `[N]` for the split.

    Refuses rounds without confidence logits (`no_usable_rounds` says why a pool holds none)."""
    if (missing := table.first_without_confidence()) is not None:
        path, request, rnd = missing
        raise InputError(f"{path}: request {request} round {rnd} has no confidence logits",
                         "calibration needs a draft with a confidence head (DSpark, not DFlash)")
    return CalibrationData(table.logits, table.verify_length, table.accepted), table.request


def no_usable_rounds(table: RoundTable | None, shards: int = 0) -> InputError:
    """The error for inputs that hold no drafted round verifying a draft, naming the real cause per
    trace (none recorded, the policy skipped the draft, verified nothing) and how to record one."""
    if table is None or not table.paths:
        return InputError(f"the {shards} SGLang shard(s) hold no rounds",
                          "collect some with SGLANG_DSPARK_STS_COLLECT_PATH set while the server decodes")
    causes = [describe_rounds(c, h, p) for c, h, p in zip(table.counts, table.headers, table.paths)]
    shown = "; ".join(causes[:3]) + (f"; and {len(causes) - 3} more" if len(causes) > 3 else "")
    return InputError(f"nothing to calibrate (no drafted round verified a draft): {shown}",
                      recording_fix(table.counts[0], table.headers[0], table.paths[0] if len(table.paths) == 1 else None))


Inputs = tuple[CalibrationData, torch.Tensor, list[dict[str, Any]]]  # rounds, request keys, the traces' headers


def _load_inputs(paths: Sequence[str | os.PathLike], progress: Progress | None = None) -> Inputs:
    """Traces (JSON lines, streamed) and SGLang shards (.pt) pooled: (data, request keys, trace headers)."""
    seen: dict[tuple[int, int], Path] = {}
    for p in map(Path, paths):
        if p.is_file():
            st = p.stat()
            if (st.st_dev, st.st_ino) in seen:  # the same rounds twice would count twice
                raise InputError(f"{p} is given twice (also as {seen[(st.st_dev, st.st_ino)]})",
                                 "pass each trace or shard once")
            seen[(st.st_dev, st.st_ino)] = p
    is_shard = [Path(p).suffix.lower() == ".pt" for p in paths]
    shards = [p for p, s in zip(paths, is_shard) if s]
    rest = [p for p, s in zip(paths, is_shard) if not s]
    headers: list[dict[str, Any]] = []
    parts, keys, table = [], [], None
    if rest:
        table = read_round_table(rest, "calibrate", progress)
        data, k = calibration_data(table)
        headers = table.headers
        parts.append((data.logits, data.verify_length, data.accepted))
        keys.append(k)
    contents: dict[bytes, Any] = {}
    for p in shards:
        lg, acc = read_sglang_shard(p)
        digest = hashlib.blake2b(lg.numpy().tobytes() + acc.numpy().tobytes(), digest_size=16).digest()
        if digest in contents:  # a copy under another name counts twice as surely as the same path
            raise InputError(f"{p} holds the same rows as {contents[digest]}: a copy of one shard",
                             "pass each trace or shard once")
        contents[digest] = p
        parts.append((lg, torch.full_like(acc, lg.shape[1]), acc))
        start = int(keys[-1].max()) + 1 if keys and keys[-1].numel() else 0
        keys.append(torch.arange(start, start + lg.shape[0]))  # shards hold no request ids: one key per row
    gammas = {lg.shape[1] for lg, _, _ in parts}
    if len(gammas) > 1:
        raise InputError(f"the inputs mix block sizes {sorted(gammas)}", "calibrate one block size at a time")
    if not parts or sum(int(ell.sum()) for _, ell, _ in parts) == 0:  # no position was ever tested
        raise no_usable_rounds(table, len(shards))
    data = CalibrationData(torch.cat([a for a, _, _ in parts]), torch.cat([b for _, b, _ in parts]),
                           torch.cat([c for _, _, c in parts]))
    return data, torch.cat(keys), headers


def check_settings(holdout: float, bins: int) -> None:
    """The split and the bin count, before any trace is read."""
    if not 0.0 < holdout < 1.0:
        raise UsageError(f"{option('holdout')} must be in (0, 1), got {holdout}", "hold out a fraction such as 0.2")
    if bins < 2:
        raise UsageError(f"{option('bins')} must be ≥ 2, got {bins}", "use e.g. 20 bins")


def load_inputs(trace_paths: Sequence[str | os.PathLike], bins: int, progress: Progress | None = None) -> Inputs:
    """The pooled rounds (`_load_inputs`), with `bins` bounded by them: at most one bin per recorded
    round (more bins than rounds only adds empty ones, and each costs memory in the fit and a row
    in every reliability diagram)."""
    data, keys, headers = _load_inputs(trace_paths, progress)
    if bins > data.logits.shape[0]:
        raise UsageError(f"{option('bins')} {bins} is more than the {data.logits.shape[0]} rounds in the traces",
                         f"use at most {data.logits.shape[0]} bins (e.g. 20)")
    return data, keys, headers


def calibrate_traces(trace_paths: Sequence[str | os.PathLike], holdout: float = 0.2, bins: int = 20,
                    seed: int = 0) -> dict[str, Any]:
    """Read, split by request, fit STS on the training part, measure before/after on the held-out part
    (in memory; `run_calibrate` also checks and writes the outputs)."""
    check_settings(holdout, bins)
    return fit_calibration(trace_paths, load_inputs(trace_paths, bins), holdout, bins, seed)


MIN_OUTCOME = 10  # fewer accepted (or rejected) trials than this at a position: its fitted T is noise


def fit_warning(r: dict[str, Any], t: float) -> str:
    """What went wrong in the fit of one position (`fit_sts`'s report entry `r`, its temperature `t`),
    by what actually happened: no trials, one outcome only, too few trials, too few of one outcome,
    or a temperature at the end of the grid despite enough of both."""
    k, n, acc = r["position"], r["trials"], r["successes"]
    where = f"position {k}: "
    if r["status"] == "too few":
        if n == 0:
            return where + "no recorded round reached this position; T = 1 kept (record longer or more rounds)"
        if acc in (0, n) and n >= MIN_FIT_TRIALS:
            return where + (f"all {n} trials were {'rejected' if acc == 0 else 'accepted'}: with one outcome only "
                            "there is nothing to calibrate; T = 1 kept")
        return where + f"only {n} trials ({acc} accepted), {MIN_FIT_TRIALS} needed to fit; T = 1 kept (record more rounds)"
    few = min(acc, n - acc)
    if few < MIN_OUTCOME:
        return where + (f"only {few} of {n} trials were {'accepted' if acc == few else 'rejected'}: too few to fit "
                        f"a temperature; T = {t:.3g} is the edge of the search grid [0.05, 20] (record more rounds)")
    return where + (f"T = {t:.3g} is at the edge of the search grid [0.05, 20] with {acc} of {n} trials accepted: "
                    "no temperature calibrates it (its confidences are off by a bias, not a scale)")


def fit_calibration(trace_paths: Sequence[str | os.PathLike],
                    inputs: Inputs, holdout: float, bins: int, seed: int) -> dict[str, Any]:
    """The calibration document of `inputs` (`load_inputs` of `trace_paths`)."""
    data, keys, headers = inputs
    gen = torch.Generator().manual_seed(seed)
    hold = split_requests(keys, holdout, gen)
    train, held = data.subset(~hold), data.subset(hold)
    if train.logits.shape[0] == 0 or held.logits.shape[0] == 0:
        raise InputError("too few requests to split into training and held-out parts",
                         f"record more requests or change {option('holdout')}")
    fit_report: list[dict] = []
    temps = fit_sts(train, bins=bins, report=fit_report)
    warnings = [fit_warning(r, float(temps[r["position"] - 1])) for r in fit_report if r["status"] != "fitted"]
    ones = torch.ones_like(temps)
    before, after = position_metrics(held, ones, bins), position_metrics(held, temps, bins)
    train_fit = position_metrics(train, temps, bins)
    return {
        "format": CALIBRATION_FORMAT,
        "block_size": data.gamma,
        "temperatures": [float(t) for t in temps],
        "method": "sequential temperature scaling (grid search of T_k minimising survival ECE, left to right)",
        "fit": fit_report, "warnings": warnings,
        "draft_fingerprints": sorted({str(h["draft_fingerprint"]) for h in headers
                                      if isinstance(h.get("draft_fingerprint"), str)}),
        "bins": bins, "holdout": holdout, "seed": seed,
        "rounds": {"train": int(train.logits.shape[0]), "heldout": int(held.logits.shape[0]),
                   "requests_heldout": int(torch.unique(keys[hold]).numel()),
                   "requests_train": int(torch.unique(keys[~hold]).numel())},
        "metrics_heldout": {"before": before, "after": after},
        "metrics_train_after": [{k: v for k, v in m.items() if k != "diagram"} for m in train_fit],
        "provenance": provenance(inputs=[str(p) for p in trace_paths],
                                 trace_headers=[{k: h.get(k) for k in
                                                 ("target", "draft", "dataset", "temperature", "seed", "policy")
                                                 if k in h} for h in headers]),
    }


def confidence_report(rounds: Sequence[Any], calibration: str | os.PathLike | None) -> dict[str, Any] | None:
    """How well the confidence head predicted the outcomes of `rounds` (trace rows of drafted steps:
    confidence_logits, verify_length, accepted): per position n, ECE, AUROC and Brier of the survival
    estimate, raw (T = 1) and with the calibration's temperatures. None for a draft without a head."""
    rows = [r for r in rounds if r.drafted and r.confidence_logits is not None]
    if not rows:
        return None
    data = CalibrationData(torch.tensor([r.confidence_logits for r in rows], dtype=torch.float64),
                           torch.tensor([r.verify_length for r in rows]), torch.tensor([r.accepted for r in rows]))
    ones = torch.ones(data.gamma, dtype=torch.float64)
    temps = torch.tensor(load_temperatures(calibration, data.gamma), dtype=torch.float64) if calibration else None
    keep = ("n", "ece", "auroc", "brier", "mean_pred", "survival_rate")

    def metrics(t: torch.Tensor) -> list[dict[str, Any]]:
        return [finite({k: m[k] for k in keep}) for m in position_metrics(data, t)]

    raw = metrics(ones)
    cal = metrics(temps) if temps is not None else None
    return {"calibration": str(calibration) if calibration else None,
            "temperatures": temps.tolist() if temps is not None else None, "rounds": len(rows),
            "positions": [{"position": k + 1, "n": raw[k]["n"], "survival_rate": raw[k]["survival_rate"],
                           "raw": {x: raw[k][x] for x in ("ece", "auroc", "brier", "mean_pred")},
                           "calibrated": ({x: cal[k][x] for x in ("ece", "auroc", "brier", "mean_pred")}
                                          if cal is not None else None)} for k in range(data.gamma)]}
