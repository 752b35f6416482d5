"""`sweep-scheduler`: check the outputs, replay recorded rounds under each policy and concurrency
(tuning/sweep.py), write the JSON and the frontier figure together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs
from dsparkctl.errors import option
from dsparkctl.files.atomic import staged, write_json
from dsparkctl.formats.sps import load_sps_table
from dsparkctl.formats.trace_scan import Progress
from dsparkctl.plots import frontier_plot
from dsparkctl.serving.engines import k_table_from_sweep
from dsparkctl.tuning.sweep import DEFAULT_CONCURRENCY, sweep_traces


@dataclass(frozen=True)
class SweepSpec:
    """Everything `sweep-scheduler` runs, as the user gave it (`run_sweep_scheduler` checks it)."""
    traces: tuple[Path, ...]  # full-verification traces (or none, with `served`)
    sps_table: Path  # ours or SGLang's
    policies: tuple[str, ...] | None = None  # None: DEFAULT_POLICIES, or static:0..γ with `served`
    served: Path | None = None  # `dsparkctl served --out` document, in place of traces
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    calibration: Path | None = None  # our calibration JSON or SGLang's STS file
    rounds: int = 20_000  # request-rounds replayed per cell
    max_new_tokens: int | None = None  # None: the steady state; N: finite batches of N new tokens per request
    plot: Path | None = None  # the frontier figure
    out: Path | None = None  # the sweep JSON
    seed: int = 0


BY_CONTEXT_NOTE = ("by_context: a length table per (batch size, context length) from the table's per-context costs "
                   "and, where `served --context-buckets` measured it, that bucket's acceptance. vLLM takes one "
                   "num_speculative_tokens_per_batch_size table today and SGLang an SPS table by batch tokens only; "
                   "no engine reads a per-context table yet: serve the one for your traffic's typical context")


def _context_plan(spec: SweepSpec, context_len: int) -> dict[str, Any]:
    swept = sweep_traces(spec.traces, spec.sps_table, spec.policies, spec.concurrency, spec.calibration, spec.rounds,
                         spec.seed, max_new_tokens=spec.max_new_tokens, served=spec.served, context_len=context_len)
    src = swept["acceptance_source"]
    return {"context_len": context_len, "acceptance_prompt_tokens": src.get("prompt_tokens"),
            "vllm_length_table": k_table_from_sweep(swept, block_size=None)}


def run_sweep_scheduler(spec: SweepSpec, *, log: Callable[[str], None] = lambda m: None,
                        progress: Progress | None = None) -> dict[str, Any]:
    """`sweep-scheduler` as one call: check every output, then the settings and the inputs and
    replay every cell (`sweep_traces`), then write the figure and the JSON together (both appear, or neither). Returns
    the sweep document; `log` is told what was written, `progress(done, total)` the trace bytes read."""

    inputs = [Path(p) for p in (*spec.traces, spec.sps_table, *([spec.calibration] if spec.calibration else []),
                                *([spec.served] if spec.served else []))]
    check_outputs([Output(p, option(field), kind) for p, field, kind in
                   ((spec.plot, "plot", "figure"), (spec.out, "out", "file")) if p is not None], inputs=inputs)
    result = sweep_traces(spec.traces, spec.sps_table, spec.policies, spec.concurrency, spec.calibration, spec.rounds,
                       spec.seed, max_new_tokens=spec.max_new_tokens, served=spec.served, progress=progress)
    if spec.served is not None:  # the lengths by load, in the form vLLM takes them (serve-config writes its command)
        result["vllm_length_table"] = k_table_from_sweep(result, block_size=None)
        contexts = load_sps_table(spec.sps_table).meta.get("by_context")
        if isinstance(contexts, list):
            result["by_context"] = [_context_plan(spec, e.get("context_len")) for e in contexts if isinstance(e, dict)]
            result["notes"].append(BY_CONTEXT_NOTE)
    with staged() as stage:
        if spec.plot:

            frontier_plot(result["rows"], stage(spec.plot), as_path=spec.plot)
        if spec.out:
            write_json(stage(spec.out), result)
    for p in (spec.plot, spec.out):
        if p:
            log(f"wrote {p}")
    return result
