"""`profile-sps`: check the grid and every output before any model loads (and the grid against the
model before kernel timing), time the engine's step over the grid (engine/profile.py), fit the
table and write ours, SGLang's twin and the PNG together.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs, local_inputs
from dsparkctl.distributed import one_process
from dsparkctl.engine.profile import (MEASURES, SETTLE_TOKENS, check_batch_tokens, check_context, check_grid,
                                      check_verify_width, profile_table)
from dsparkctl.engine.session import ModelSettings, open_session, open_target
from dsparkctl.errors import UsageError, option
from dsparkctl.files.atomic import staged
from dsparkctl.formats.sps import save_sps_table
from dsparkctl.plots import plot_sps

MAX_REPEATS = 1000  # per grid point; a typo such as 99999999999 would profile for years


@dataclass(frozen=True)
class ProfileSpec(ModelSettings):
    """Everything `profile-sps` runs, as the user gave it (`run_profile_sps` checks it)."""
    out: Path = Path("sps.json")  # our table; the SGLang table and the PNG default beside it
    sglang_out: Path | None = None  # None: <out stem>.sglang.json
    plot: Path | None = None  # None: <out stem>.png
    measure: str = "whole-step"  # one of MEASURES
    requests: tuple[int, ...] = (1, 2, 4, 8)
    tokens_per_request: tuple[int, ...] | None = None  # None: 1..γ+1 (whole-step) or 1,2,3,4,6,8
    context_len: int = 256  # cached context tokens per request
    repeats: int = 12  # timed repeats per point (the fit reads their lower quartile)
    warmup: int = 2  # untimed warm-up steps per point
    draft: str | None = None  # whole-step only; None: the shipped draft


def run_profile_sps(spec: ProfileSpec, *,
                    log: Callable[[str], None] = lambda m: None,
                    on_progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, Any], Any]:
    """Check the spec (numbers, grid, every output path before any model loads; the grid against
    the model before kernel timing), profile, fit, write our table, SGLang's and the PNG: (the
    result document, the SPSTable). `on_progress(done, total)` counts grid points."""
    whole = spec.measure == "whole-step"
    _check_settings(spec)
    inputs = local_inputs(target=spec.target, drafts=[spec.draft])
    def named_after(out: Path) -> tuple[Path, Path]:  # SGLang's table and the PNG, by default beside `out`
        return spec.sglang_out or out.with_name(out.stem + ".sglang.json"), spec.plot or out.with_suffix(".png")

    check_outputs([Output(spec.out, option("out"))], inputs,
                  derived=lambda out: [Output(named_after(out)[0], option("sglang_out")),
                                       Output(named_after(out)[1], option("plot"), "figure")])
    sg, png = named_after(spec.out)
    reqs = list(spec.requests)
    toks = list(spec.tokens_per_request) if spec.tokens_per_request is not None else (None if whole else [1, 2, 3, 4, 6, 8])
    if toks is not None:
        check_grid(reqs, toks)  # before any model loads
    check_batch_tokens(reqs, toks or [8], spec.context_len)
    if whole:
        sess = open_session(spec.target, spec.draft, spec.device, spec.dtype, spec.revision, spec.trust_remote_code,
                            spec.seed, log=log, cpu_kernels=spec.cpu_kernels, settle=False,
                            draft_weights=spec.draft_weights)
        gamma = sess.draft.block_size
        if toks is None:
            toks = list(range(1, gamma + 2))
            check_grid(reqs, toks)
        check_verify_width(gamma, toks)
    else:
        sess = open_target(spec.target, spec.device, spec.dtype, spec.revision, spec.trust_remote_code, log=log,
                           cpu_kernels=spec.cpu_kernels, settle=False, draft_weights=spec.draft_weights)
    check_context(sess.target.model, spec.context_len, toks, settle=SETTLE_TOKENS if whole else 0)
    sess.settle_kernels(log)  # every input is checked: the timing is not wasted
    done = itertools.count(1)
    n_points = len(set(reqs)) * (len(set(toks)) + whole)
    drafted = ((str(Path(spec.draft).resolve()) if spec.draft and Path(spec.draft).exists() else sess.draft_name)
               if whole else None)
    table, warnings = profile_table(sess, spec.measure, reqs, toks, spec.context_len, spec.repeats, spec.warmup,
                                    spec.seed, on_point=(lambda p: on_progress(next(done), n_points))
                                    if on_progress else None, draft=drafted)
    bt, sps = table.batch_tokens, table.steps_per_sec
    dev, dt = sess.device, str(sess.dtype).replace("torch.", "")
    with staged() as stage:  # the three appear together, or none (serve-config reads the SGLang twin beside ours)
        plot_sps(bt, sps, stage(png), f"{sess.target.name} on {dev} ({dt}), context {spec.context_len}, "
                 f"{spec.measure}", as_path=png)
        save_sps_table(table, stage(sg), fmt="sglang")
        save_sps_table(table, stage(spec.out), fmt="dsparkctl")
    doc = {"table": str(spec.out), "sglang_table": str(sg), "plot": str(png), "measures": spec.measure,
           "batch_tokens": bt, "steps_per_sec": [round(s, 3) for s in sps],
           "ms_per_step": [round(1000 / s, 3) for s in sps], "grid": table.grid.to_json(), "warnings": warnings}
    return doc, table


def _check_settings(spec: ProfileSpec) -> None:
    """The measure, the device layout and the numbers, before any path or model."""
    one_process("profile-sps")
    if spec.measure not in MEASURES:
        raise UsageError(f"unknown measure {spec.measure!r}", f"use one of {', '.join(MEASURES)}")
    if spec.measure != "whole-step" and (spec.draft is not None or spec.draft_weights not in ("auto", "fp32")):
        given = option("draft") if spec.draft is not None else f"{option('draft_weights')} {spec.draft_weights}"
        raise UsageError(f"{option('measure')} {spec.measure} times the target alone; {given} would not be used",
                         f"drop {given}, or use {option('measure')} whole-step")
    if spec.target_parallel != "none":
        raise UsageError(f"profile-sps times one process on one device; {option('target_parallel')} "
                         f"{spec.target_parallel!r} is for generate and eval-acceptance",
                         "profile the target on one device (the table's costs are per device)")
    if spec.context_len < 1 or spec.repeats < 1 or spec.warmup < 0:
        raise UsageError(f"{option('context_len')} and {option('repeats')} must be >= 1, {option('warmup')} >= 0",
                         f"e.g. {option('context_len')} 256 {option('repeats')} 12 {option('warmup')} 2")
    if spec.repeats > MAX_REPEATS or spec.warmup > MAX_REPEATS:
        raise UsageError(f"{option('repeats')} and {option('warmup')} must be at most {MAX_REPEATS}, got "
                         f"{spec.repeats} and {spec.warmup}",
                         f"e.g. {option('repeats')} 12 {option('warmup')} 2 (quartiles settle within a dozen)")
