"""`served`: read an engine's speculative counters or responses (serving/served.py), optionally
set them beside our offline measurement (serving/parity.py), and write the document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs
from dsparkctl.errors import UsageError, option
from dsparkctl.files.atomic import write_json
from dsparkctl.serving.parity import parity, read_offline
from dsparkctl.serving.served import by_context, check_bucket_sources, check_sources, is_url, read_sources, served_report

MEASURES = ("live", "teacher-forced")


@dataclass(frozen=True)
class ServedSpec:
    """Everything `served` runs, as the user gave it (`run_served` checks it)."""
    sources: tuple[str, ...]  # scrape files, metrics URLs or response files
    offline: Path | None = None  # eval-acceptance --json document or a generate --trace file
    offline_dataset: str | None = None  # which dataset of the document (needed when it holds several)
    offline_draft: str | None = None  # which draft label of it
    offline_measure: str | None = None  # live | teacher-forced (default: live where present)
    model: str | None = None  # the served model name, where a source holds several
    out: Path | None = None  # the served document, for sweep-scheduler / serve-config --served
    fail_on_mismatch: bool = False  # exit non-zero unless the verdict is "agree"
    context_buckets: tuple[int, ...] = ()  # prompt-length edges: acceptance per bucket too (response files only)


def run_served(spec: ServedSpec, *, log: Callable[[str], None] = lambda m: None,
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Check the output and the sources, read them, report, compare with offline if given, write
    the document. Returns it. `progress(done, total)` counts an offline trace's bytes read."""

    local = [Path(s).expanduser() for s in spec.sources if not is_url(s)]
    check_outputs([Output(spec.out, option("out"))] if spec.out else [],
                  inputs=local + ([spec.offline] if spec.offline else []))
    if spec.offline_measure is not None and spec.offline_measure not in MEASURES:
        raise UsageError(f"{option('offline_measure')} must be live or teacher-forced, got {spec.offline_measure!r}",
                         f"use {option('offline_measure')} live or teacher-forced")
    if spec.offline is None and (spec.offline_dataset or spec.offline_draft or spec.offline_measure
                                 or spec.fail_on_mismatch):
        raise UsageError(f"{option('offline_dataset')}, {option('offline_draft')}, {option('offline_measure')} and "
                         f"{option('fail_on_mismatch')} choose and judge the offline result",
                         f"add {option('offline')} FILE (eval-acceptance --json output or a trace)")
    check_sources(spec.sources)
    if list(spec.context_buckets) != sorted(set(spec.context_buckets)):
        raise UsageError(f"{option('context_buckets')} must be increasing prompt lengths", "e.g. 256,1024")
    if spec.context_buckets:
        check_bucket_sources(spec.sources)
    offline = (read_offline(spec.offline, spec.offline_dataset, spec.offline_draft, spec.offline_measure, progress)
               if spec.offline else None)
    doc = served_report(read_sources(spec.sources, spec.model), spec.sources)
    if spec.context_buckets:
        doc["by_context"] = by_context(spec.sources, spec.context_buckets, spec.model)
    if offline is not None:
        if not doc["per_position"]:
            raise UsageError("the served source has no per-position counts to compare",
                             "pass a vLLM scrape with its per-position series, or per-request responses")
        doc["parity"] = parity(doc, offline)
    if spec.out:
        write_json(spec.out, doc)
        log(f"wrote {spec.out}")
    return doc
