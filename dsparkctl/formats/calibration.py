"""Calibration files: ours (`dsparkctl calibrate`), SGLang's STS file, and SGLang's calibration shards.

SGLang's STS file (`--speculative-dspark-confidence-sts-path`) is read by `DSparkStsCalibration`
in sglang `python/sglang/srt/speculative/dspark_components/dspark_sts.py` (a msgspec struct):
`temperatures: list[float]` (required, all > 0), optional `dataset: str`, `num_samples: int`,
`ece_before: list[float]`, `ece_after: list[float]`. We write exactly those keys.
`temperatures_of` is the one validator of a temperatures list, whichever file holds it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from dsparkctl.errors import InputError, UsageError
from dsparkctl.strict_json import read

CALIBRATION_FORMAT = "dsparkctl-calibration/1"


MAX_SHARD_GAMMA = 256


_SHARD_HINT = "give a shard SGLang wrote (a .pt of plain tensors: logits and prefix_mask [N, γ])"


def read_sglang_shard(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard SGLang writes under SGLANG_DSPARK_STS_COLLECT_PATH (`<stem>.<n>.pt`, sglang
    `dspark_sts.py` StsDataRecorder): {"logits": [N, γ] raw confidence logits, "prefix_mask":
    [N, γ] with position k = 1 iff drafts 1..k+1 matched the target's argmax, optionally
    "observed_mask" [N, γ]}. Read with torch.load(weights_only=True) only: anything that is not
    plain tensors is refused, never unpickled. Returns (logits [N, γ] float64, accepted [N])."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"STS shard {path} does not exist or is not a regular file", _SHARD_HINT)
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
            raise InputError(f"{path}: {name} must be a 2-D float tensor [N, γ]", _SHARD_HINT)
    if logits.shape != mask.shape or logits.shape[1] < 1:
        raise InputError(f"{path}: logits {list(logits.shape)} and prefix_mask {list(mask.shape)} differ", _SHARD_HINT)
    if logits.shape[1] > MAX_SHARD_GAMMA:
        raise InputError(f"{path}: {logits.shape[1]} positions per row; no DSpark block is that long "
                         f"(at most {MAX_SHARD_GAMMA})", "pass SGLang's STS shards [N, γ]")
    if not bool(torch.isfinite(logits).all()):
        raise InputError(f"{path}: logits hold NaN or infinite values", _SHARD_HINT)
    m = mask.to(torch.float64)
    if not bool(((m == 0) | (m == 1)).all()) or bool((m[:, 1:] > m[:, :-1]).any()):
        raise InputError(f"{path}: prefix_mask must be 0/1 and non-increasing along positions (a prefix)", _SHARD_HINT)
    keep = torch.ones(m.shape[0], dtype=torch.bool)
    if "observed_mask" in obj:
        obs = obj["observed_mask"]
        if not torch.is_tensor(obs) or obs.layout != torch.strided or obs.shape != m.shape:
            raise InputError(f"{path}: observed_mask must be a tensor shaped like logits {list(m.shape)}", _SHARD_HINT)
        if not bool(((obs == 0) | (obs == 1)).all()):
            raise InputError(f"{path}: observed_mask must hold 0/1 only", _SHARD_HINT)
        keep = obs.to(torch.float64).min(dim=1).values > 0  # fully observed rows
    return logits.to(torch.float64)[keep], m[keep].sum(dim=1).long()


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


def calibration_draft_notes(path: str | os.PathLike, fingerprint: str | Sequence[str]) -> list[str]:
    """Refuse a calibration fitted on another draft's traces: its fingerprints exclude this draft's
    (`fingerprint`), or one of the drafts' whose rounds it will be applied to (a sequence, as the
    sweep's traces say), or it was fitted on several drafts' traces pooled. A file that does not say
    (SGLang's STS file, older files) gets a note instead. The one check of a calibration against its
    draft: every consumer calls it."""
    obj = read(Path(path), "calibration file", "write one with `dsparkctl calibrate`")
    fps = obj.get("draft_fingerprints") if isinstance(obj, dict) else None
    if not isinstance(fps, list) or not fps:
        return [f"{path} does not say which draft it was fitted for; make sure it is this draft's"]
    if len(set(map(str, fps))) > 1:  # an older calibrate pooled two drafts' traces: it fits neither
        raise InputError(f"{path} was fitted on the pooled traces of {len(set(map(str, fps)))} drafts "
                         f"(fingerprints {', '.join(map(str, fps))}): its temperatures suit none of them",
                         "calibrate each draft on its own traces: `dsparkctl calibrate t.jsonl` with this "
                         "draft's traces only")
    mine = [fingerprint] if isinstance(fingerprint, str) else list(fingerprint)
    if other := [f for f in mine if f not in fps]:
        raise InputError(f"{path} was fitted on traces of another draft (fingerprint {', '.join(map(str, fps))}; "
                         f"this draft's is {', '.join(other)})",
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


def temperatures_of(obj: Any, path: str | os.PathLike) -> list[float]:
    """The `temperatures` of a calibration document (ours or SGLang's STS file): a non-empty list of
    finite positive numbers, one per draft position; the one check of them, whoever reads them."""
    temps = obj.get("temperatures") if isinstance(obj, dict) else None
    if (not isinstance(temps, list) or not temps
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
                       for t in temps)):
        raise InputError(f"{path}: 'temperatures' must be a non-empty list of positive numbers",
                         "write the file with `dsparkctl calibrate` (our JSON, or the .sglang-sts.json beside it)")
    return [float(t) for t in temps]


def load_temperatures(path: str | os.PathLike, gamma: int | None = None) -> list[float]:
    """Temperatures from our calibration JSON or SGLang's STS file; checks the block size."""
    path = Path(path)
    temps = temperatures_of(read(path, "calibration file", "write one with `dsparkctl calibrate`"), path)
    if gamma is not None and len(temps) != gamma:
        raise UsageError(f"{path}: temperatures are for block size {len(temps)} but the traces have block size {gamma}",
                         "calibrate on traces recorded with the same block size")
    return temps


CALIBRATION_NAME = "calibration.json"  # a draft folder's own calibration (`dsparkctl calibrate` output shipped with it)


def own_calibration(folder: str | os.PathLike | None, fingerprint: str) -> Path | None:
    """`calibration.json` in a draft's folder when it was fitted for this very draft (its
    fingerprint is the only one listed); None when there is no such file, or it does not say, or it
    is another draft's or several drafts' pooled. A damaged file (not strict JSON) is an InputError: it is there to be used."""
    if folder is None:
        return None
    path = Path(folder) / CALIBRATION_NAME
    if not path.is_file():
        return None
    obj = read(path, "calibration file", "write one with `dsparkctl calibrate`, or remove it")
    fps = obj.get("draft_fingerprints") if isinstance(obj, dict) else None
    return path if isinstance(fps, list) and set(map(str, fps)) == {fingerprint} else None
