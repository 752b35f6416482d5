"""`calibrate`: check every output and setting, fit STS temperatures on traces and SGLang shards
(tuning/calibration.py), then write our JSON, SGLang's STS file and one reliability PNG per
position, all together or none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs
from dsparkctl.errors import option
from dsparkctl.files.atomic import write_json
from dsparkctl.files.commit import transaction
from dsparkctl.formats.calibration import sglang_sts
from dsparkctl.formats.trace_scan import Progress
from dsparkctl.plots import reliability_diagrams, reliability_paths
from dsparkctl.tuning.calibration import check_settings, fit_calibration, load_inputs


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


def run_calibrate(spec: CalibrateSpec, *, log: Callable[[str], None] = lambda m: None,
                  progress: Progress | None = None) -> dict[str, Any]:
    """`calibrate` as one call: check every output (and the settings, the traces, the PNG names)
    before the fit, fit and measure (`fit_calibration`), then write our JSON, SGLang's STS file and
    one reliability PNG per position, all together or none. Returns our document (with the
    diagrams; `strip_diagrams` for printing); `log` is told what was written, `progress(done, total)`
    the trace bytes read."""

    def named_after(out: Path) -> tuple[Path, Path]:  # SGLang's file and the PNG folder, by default beside `out`
        return (spec.sglang_out or out.with_name(out.stem + ".sglang-sts.json"),
                spec.plot_dir or out.with_name(out.stem + "_reliability"))

    check_outputs([Output(spec.out, option("out"))], inputs=[Path(p) for p in spec.traces],
                  derived=lambda out: [Output(named_after(out)[0], option("sglang_out")),
                                       Output(named_after(out)[1], option("plot_dir"), "folder", whole=False)])
    sglang_out, plot_dir = named_after(spec.out)
    check_settings(spec.holdout, spec.bins)
    inputs = load_inputs(spec.traces, spec.bins, progress)
    reliability_paths(plot_dir, inputs[0].gamma)  # a user's file among the PNG names stops it before the fit
    result = fit_calibration(spec.traces, inputs, spec.holdout, spec.bins, spec.seed)
    with transaction() as tx:  # all outputs appear together, or none (a full disk leaves nothing)
        pngs = reliability_diagrams(result, plot_dir, tx.file)
        tx.prune(plot_dir, r"reliability_pos[0-9]+\.png")  # an earlier run's positions past this γ (ours only)
        result["outputs"] = {"sglang_sts": str(sglang_out), "reliability_pngs": pngs}
        write_json(tx.file(sglang_out), sglang_sts(result))
        write_json(tx.file(spec.out), result)
    log(f"wrote {spec.out}, {sglang_out}, {len(pngs)} reliability PNGs in {plot_dir}")
    return result


def strip_diagrams(result: dict[str, Any]) -> dict[str, Any]:
    """A copy without the per-bin diagram arrays (for compact printing)."""
    out = json.loads(json.dumps(result))
    for side in ("before", "after"):
        for m in out["metrics_heldout"][side]:
            m.pop("diagram", None)
    return out
