"""`calibrate`: fit STS temperatures on traces, report held-out metrics, write our JSON and SGLang's.

`run_calibrate(CalibrateSpec)` is the command as one call (every check, the fit, all outputs
written together); `run_calibration` is the fit and its metrics alone, in memory.

SGLang's STS file (`--speculative-dspark-confidence-sts-path`) is read by
`DSparkStsCalibration` in sglang `python/sglang/srt/speculative/dspark_components/dspark_sts.py`
(msgspec struct): `temperatures: list[float]` (required, all > 0), optional `dataset: str`,
`num_samples: int`, `ece_before: list[float]`, `ece_after: list[float]`. We write exactly those keys.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.math.calibration import CalibrationData, fit_sts, position_metrics, split_requests
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import finite, read
from dsparkctl.trace import Trace, read_traces

CALIBRATION_FORMAT = "dsparkctl-calibration/1"


def calibration_data(traces: Sequence[Trace]) -> tuple[CalibrationData, torch.Tensor]:
    """All rounds of the traces as tensors, plus a request key `[N]` for the split.

    Refuses rounds without confidence logits and mixed block sizes."""
    logits, ell, acc, keys = [], [], [], []
    ids: dict[tuple[int, int], int] = {}  # (file, request) -> dense request key
    gamma = None
    for fi, t in enumerate(traces):
        for r in t.rounds:
            if not r.drafted:  # a plain step the policy chose: no draft, nothing to calibrate
                continue
            if r.confidence_logits is None:
                raise InputError(f"{t.path}: request {r.request} round {r.round} has no confidence logits",
                                 "calibration needs a draft with a confidence head (DSpark, not DFlash)")
            if gamma is None:
                gamma = r.block_size
            elif r.block_size != gamma:
                raise InputError(f"{t.path}: block size {r.block_size} differs from {gamma} in earlier rounds",
                                 "calibrate traces of one block size at a time")
            logits.append(r.confidence_logits)
            ell.append(r.verify_length)
            acc.append(r.accepted)
            keys.append(ids.setdefault((fi, r.request), len(ids)))
    if not logits:
        raise InputError("the traces contain no rounds", "record some with `dsparkctl generate --trace`")
    return (CalibrationData(torch.tensor(logits, dtype=torch.float64), torch.tensor(ell), torch.tensor(acc)),
            torch.tensor(keys))


MAX_SHARD_GAMMA = 256


def read_sglang_shard(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard SGLang writes under SGLANG_DSPARK_STS_COLLECT_PATH (`<stem>.<n>.pt`, sglang
    `dspark_sts.py` StsDataRecorder): {"logits": [N, γ] raw confidence logits, "prefix_mask":
    [N, γ] with position k = 1 iff drafts 1..k+1 matched the target's argmax, optionally
    "observed_mask" [N, γ]}. Read with torch.load(weights_only=True) only: anything that is not
    plain tensors is refused, never unpickled. Returns (logits [N, γ] float64, accepted [N])."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"STS shard {path} does not exist or is not a regular file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - weights_only's unpickler raises many kinds on hostile bytes
        raise InputError(f"{path}: not a tensors-only torch file, refused without unpickling "
                         f"({type(exc).__name__})",
                         "pass SGLang's STS shards (logits, prefix_mask) or dsparkctl traces") from None
    if not isinstance(obj, dict) or not {"logits", "prefix_mask"} <= set(obj):
        raise InputError(f"{path}: expected a dict with 'logits' and 'prefix_mask' tensors",
                         "pass the .pt shards SGLang writes under SGLANG_DSPARK_STS_COLLECT_PATH")
    logits, mask = obj["logits"], obj["prefix_mask"]
    for name, t in (("logits", logits), ("prefix_mask", mask)):
        if not torch.is_tensor(t) or t.layout != torch.strided or t.dim() != 2 or not t.is_floating_point():
            raise InputError(f"{path}: {name} must be a 2-D float tensor [N, γ]")
    if logits.shape != mask.shape or logits.shape[1] < 1:
        raise InputError(f"{path}: logits {list(logits.shape)} and prefix_mask {list(mask.shape)} differ")
    if logits.shape[1] > MAX_SHARD_GAMMA:
        raise InputError(f"{path}: {logits.shape[1]} positions per row; no DSpark block is that long "
                         f"(at most {MAX_SHARD_GAMMA})", "pass SGLang's STS shards [N, γ]")
    if not bool(torch.isfinite(logits).all()):
        raise InputError(f"{path}: logits hold NaN or infinite values")
    m = mask.to(torch.float64)
    if not bool(((m == 0) | (m == 1)).all()) or bool((m[:, 1:] > m[:, :-1]).any()):
        raise InputError(f"{path}: prefix_mask must be 0/1 and non-increasing along positions (a prefix)")
    keep = torch.ones(m.shape[0], dtype=torch.bool)
    if "observed_mask" in obj:
        obs = obj["observed_mask"]
        if not torch.is_tensor(obs) or obs.layout != torch.strided or obs.shape != m.shape:
            raise InputError(f"{path}: observed_mask must be a tensor shaped like logits {list(m.shape)}")
        if not bool(((obs == 0) | (obs == 1)).all()):
            raise InputError(f"{path}: observed_mask must hold 0/1 only")
        keep = obs.to(torch.float64).min(dim=1).values > 0  # fully observed rows
    return logits.to(torch.float64)[keep], m[keep].sum(dim=1).long()


def _load_inputs(paths: Sequence[str | os.PathLike]) -> tuple[CalibrationData, torch.Tensor, list[Trace]]:
    """Traces (JSON lines) and SGLang shards (.pt) pooled: (data, request keys, traces)."""
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
    traces = read_traces(rest) if rest else []
    parts, keys = [], []
    if traces:
        data, k = calibration_data(traces)
        parts.append((data.logits, data.verify_length, data.accepted))
        keys.append(k)
    for p in shards:
        lg, acc = read_sglang_shard(p)
        parts.append((lg, torch.full_like(acc, lg.shape[1]), acc))
        start = int(keys[-1].max()) + 1 if keys and keys[-1].numel() else 0
        keys.append(torch.arange(start, start + lg.shape[0]))  # shards hold no request ids: one key per row
    gammas = {lg.shape[1] for lg, _, _ in parts}
    if len(gammas) > 1:
        raise InputError(f"the inputs mix block sizes {sorted(gammas)}", "calibrate one block size at a time")
    if not parts or sum(lg.shape[0] for lg, _, _ in parts) == 0:
        raise InputError("the inputs contain no rounds", "record some with `dsparkctl generate --trace`")
    data = CalibrationData(torch.cat([a for a, _, _ in parts]), torch.cat([b for _, b, _ in parts]),
                           torch.cat([c for _, _, c in parts]))
    return data, torch.cat(keys), traces


def check_settings(holdout: float, bins: int) -> None:
    """The split and the bin count, before any trace is read."""
    if not 0.0 < holdout < 1.0:
        raise UsageError(f"{option('holdout')} must be in (0, 1), got {holdout}", "hold out a fraction such as 0.2")
    if bins < 2:
        raise UsageError(f"{option('bins')} must be ≥ 2, got {bins}", "use e.g. 20 bins")


def load_inputs(trace_paths: Sequence[str | os.PathLike], bins: int) -> tuple[CalibrationData, torch.Tensor, list[Trace]]:
    """The pooled rounds (`_load_inputs`), with `bins` bounded by them: at most one bin per recorded
    round (more bins than rounds only adds empty ones, and each costs memory in the fit and a row
    in every reliability diagram)."""
    data, keys, traces = _load_inputs(trace_paths)
    if bins > data.logits.shape[0]:
        raise UsageError(f"{option('bins')} {bins} is more than the {data.logits.shape[0]} rounds in the traces",
                         f"use at most {data.logits.shape[0]} bins (e.g. 20)")
    return data, keys, traces


def run_calibration(trace_paths: Sequence[str | os.PathLike], holdout: float = 0.2, bins: int = 20,
                    seed: int = 0) -> dict[str, Any]:
    """Read, split by request, fit STS on the training part, measure before/after on the held-out part
    (in memory; `run_calibrate` also checks and writes the outputs)."""
    check_settings(holdout, bins)
    return fit_calibration(trace_paths, load_inputs(trace_paths, bins), holdout, bins, seed)


def fit_calibration(trace_paths: Sequence[str | os.PathLike],
                    inputs: tuple[CalibrationData, torch.Tensor, list[Trace]], holdout: float, bins: int,
                    seed: int) -> dict[str, Any]:
    """The calibration document of `inputs` (`load_inputs` of `trace_paths`)."""
    data, keys, traces = inputs
    gen = torch.Generator().manual_seed(seed)
    hold = split_requests(keys, holdout, gen)
    train, held = data.subset(~hold), data.subset(hold)
    if train.logits.shape[0] == 0 or held.logits.shape[0] == 0:
        raise InputError("too few requests to split into training and held-out parts",
                         f"record more requests or change {option('holdout')}")
    fit_report: list[dict] = []
    temps = fit_sts(train, bins=bins, report=fit_report)
    warnings = [f"position {r['position']}: T = {float(temps[r['position'] - 1]):.3g} is at the edge of the search "
                "grid [0.05, 20]: no temperature calibrates it (its confidences are off by a bias, not a scale)"
                if r["status"] == "edge" else
                f"position {r['position']}: {r['trials']} trials ({r['successes']} accepted) are too few to fit; "
                "T = 1 kept" for r in fit_report if r["status"] != "fitted"]
    ones = torch.ones_like(temps)
    before, after = position_metrics(held, ones, bins), position_metrics(held, temps, bins)
    train_fit = position_metrics(train, temps, bins)
    return {
        "format": CALIBRATION_FORMAT,
        "block_size": data.gamma,
        "temperatures": [float(t) for t in temps],
        "method": "sequential temperature scaling (grid search of T_k minimising survival ECE, left to right)",
        "fit": fit_report, "warnings": warnings,
        "draft_fingerprints": sorted({str(t.header["draft_fingerprint"]) for t in traces
                                      if isinstance(t.header.get("draft_fingerprint"), str)}),
        "bins": bins, "holdout": holdout, "seed": seed,
        "rounds": {"train": int(train.logits.shape[0]), "heldout": int(held.logits.shape[0]),
                   "requests_heldout": int(torch.unique(keys[hold]).numel()),
                   "requests_train": int(torch.unique(keys[~hold]).numel())},
        "metrics_heldout": {"before": before, "after": after},
        "metrics_train_after": [{k: v for k, v in m.items() if k != "diagram"} for m in train_fit],
        "provenance": provenance(inputs=[str(p) for p in trace_paths],
                                 trace_headers=[{k: t.header.get(k) for k in
                                                 ("target", "draft", "dataset", "temperature", "seed", "policy")
                                                 if k in t.header} for t in traces]),
    }


@dataclass(frozen=True)
class CalibrateSpec:
    """Everything `calibrate` runs, as the user gave it (`run_calibrate` checks it)."""
    traces: tuple[Path, ...]  # trace files (JSON lines) and/or SGLang STS shards (.pt)
    holdout: float = 0.2  # fraction of requests held out for the metrics
    bins: int = 20  # equal-width ECE bins
    out: Path = Path("calib.json")  # our calibration JSON
    sglang_out: Path | None = None  # None: <out stem>.sglang-sts.json
    plot_dir: Path | None = None  # None: <out stem>_reliability/
    seed: int = 0


def run_calibrate(spec: CalibrateSpec, *, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """`calibrate` as one call: check every output (and the settings, the traces, the PNG names)
    before the fit, fit and measure (`fit_calibration`), then write our JSON, SGLang's STS file and
    one reliability PNG per position, all together or none. Returns our document (with the
    diagrams; `strip_diagrams` for printing); `log` is told what was written."""
    from dsparkctl.checks import Output, check_outputs
    from dsparkctl.fsutil import staged, write_json
    from dsparkctl.plots import reliability_diagrams, reliability_paths

    check_outputs([Output(spec.out, option("out"))])  # first: the other names derive from it
    sglang_out = spec.sglang_out or spec.out.with_name(spec.out.stem + ".sglang-sts.json")
    plot_dir = spec.plot_dir or spec.out.with_name(spec.out.stem + "_reliability")
    check_outputs([Output(spec.out, option("out")), Output(sglang_out, option("sglang_out")),
                   Output(plot_dir, option("plot_dir"), "folder")], inputs=[Path(p) for p in spec.traces])
    check_settings(spec.holdout, spec.bins)
    inputs = load_inputs(spec.traces, spec.bins)
    reliability_paths(plot_dir, inputs[0].gamma)  # a user's file among the PNG names stops it before the fit
    result = fit_calibration(spec.traces, inputs, spec.holdout, spec.bins, spec.seed)
    with staged() as stage:  # all outputs appear together, or none (a full disk leaves nothing)
        pngs = reliability_diagrams(result, plot_dir, stage)
        result["outputs"] = {"sglang_sts": str(sglang_out), "reliability_pngs": pngs}
        write_json(stage(sglang_out), sglang_sts(result))
        write_json(stage(spec.out), result)
    log(f"wrote {spec.out}, {sglang_out}, {len(pngs)} reliability PNGs in {plot_dir}")
    return result


def sglang_sts(result: dict[str, Any]) -> dict[str, Any]:
    """SGLang's STS calibration file (see module doc for the schema and its source)."""
    return {
        "temperatures": result["temperatures"],
        "dataset": ",".join(Path(p).name for p in result["provenance"]["inputs"]),
        "num_samples": result["rounds"]["train"],
        "ece_before": [_finite(m["ece"]) for m in result["metrics_heldout"]["before"]],
        "ece_after": [_finite(m["ece"]) for m in result["metrics_heldout"]["after"]],
    }


def _finite(x: float) -> float:
    return 0.0 if x is None or not math.isfinite(x) else float(x)


def strip_diagrams(result: dict[str, Any]) -> dict[str, Any]:
    """A copy without the per-bin diagram arrays (for compact printing)."""
    out = json.loads(json.dumps(result))
    for side in ("before", "after"):
        for m in out["metrics_heldout"][side]:
            m.pop("diagram", None)
    return out


def calibration_draft_notes(path: str | os.PathLike, fingerprint: str) -> list[str]:
    """Refuse a calibration fitted on another draft's traces (its fingerprints exclude this one);
    a file that does not say (SGLang's STS file, older files) gets a note instead."""
    obj = read(Path(path), "calibration file", "write one with `dsparkctl calibrate`")
    fps = obj.get("draft_fingerprints") if isinstance(obj, dict) else None
    if not isinstance(fps, list) or not fps:
        return [f"{path} does not say which draft it was fitted for; make sure it is this draft's"]
    if fingerprint not in fps:
        raise InputError(f"{path} was fitted on traces of another draft (fingerprint {', '.join(map(str, fps))}; "
                         f"this draft's is {fingerprint})",
                         "calibrate this draft's traces: `dsparkctl generate --policy static:γ --trace t.jsonl`, "
                         "then `dsparkctl calibrate t.jsonl`")
    return []


def load_survival_prior(path: str | os.PathLike, gamma: int) -> list[float] | None:
    """The observed survival rate per position on the calibration's held-out rounds (our format
    only): the draft's typical survival profile, where the skip decision starts. None if absent."""
    obj = read(Path(path), "calibration file", "write one with `dsparkctl calibrate`")
    try:
        rates = [m["survival_rate"] for m in obj["metrics_heldout"]["after"]]
    except (KeyError, TypeError):
        return None
    if len(rates) != gamma or not all(isinstance(r, (int, float)) and not isinstance(r, bool)
                                       and math.isfinite(r) and 0.0 <= r <= 1.0 for r in rates):
        return None
    return [float(r) for r in rates]


def load_temperatures(path: str | os.PathLike, gamma: int | None = None) -> list[float]:
    """Temperatures from our calibration JSON or SGLang's STS file; checks the block size."""
    path = Path(path)
    obj = read(path, "calibration file", "write one with `dsparkctl calibrate`")
    temps = obj.get("temperatures") if isinstance(obj, dict) else None
    if (not isinstance(temps, list) or not temps
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
                       for t in temps)):
        raise InputError(f"{path}: 'temperatures' must be a non-empty list of positive numbers",
                         "write the file with `dsparkctl calibrate`")
    if gamma is not None and len(temps) != gamma:
        raise UsageError(f"{path}: temperatures are for block size {len(temps)} but the traces have block size {gamma}",
                         "calibrate on traces recorded with the same block size")
    return [float(t) for t in temps]


CALIBRATION_NAME = "calibration.json"  # a draft folder's own calibration (`dsparkctl calibrate` output shipped with it)


def own_calibration(folder: str | os.PathLike | None, fingerprint: str) -> Path | None:
    """`calibration.json` in a draft's folder when it was fitted for this very draft (its
    fingerprint is listed); None when there is no such file, or it does not say, or it is another
    draft's. A damaged file (not strict JSON) is an InputError: it is there to be used."""
    if folder is None:
        return None
    path = Path(folder) / CALIBRATION_NAME
    if not path.is_file():
        return None
    obj = read(path, "calibration file", "write one with `dsparkctl calibrate`, or remove it")
    fps = obj.get("draft_fingerprints") if isinstance(obj, dict) else None
    return path if isinstance(fps, list) and fingerprint in fps else None


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
