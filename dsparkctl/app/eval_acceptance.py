"""`eval-acceptance`: check every input (numbers, labels, output paths, prompt files) before any model
loads and the drafts' sizes before kernel timing, evaluate each draft on each prompt set
(evaluation/acceptance.py), write the plot and the JSON asked for, return the document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs, local_inputs
from dsparkctl.checks import check_positive
from dsparkctl.data.prompts import apply_preset_wrap, encode_prompts, load_prompts, with_preset
from dsparkctl.engine.lookup import lookup_setting
from dsparkctl.engine.session import ModelSettings, open_target
from dsparkctl.errors import UsageError, option
from dsparkctl.evaluation.acceptance import MODES, EvalOptions, drafts_under_test, evaluate_acceptance, trace_paths
from dsparkctl.evaluation.plot import plot_acceptance
from dsparkctl.files.atomic import write_json
from dsparkctl.files.commit import transaction
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.target_checks import check_positions


@dataclass(frozen=True)
class EvalSpec(ModelSettings):
    """Everything `eval-acceptance` runs, as the user gave it (`run_eval_acceptance` checks it)."""
    drafts: tuple[str | None, ...] = ()  # folders or hub ids; (): the shipped draft
    labels: tuple[str, ...] = ()  # display name per draft (same order); (): folder names or hub ids
    datasets: tuple[str, ...] = ("mt-bench",)  # built-in sets, local files or hub ids
    field: str | None = None  # prompt field of local files / hub sets
    limit: int | None = None  # first N prompts of each set
    preset: str | None = None  # data/prompts.py PRESETS
    temperature: float | None = None  # None: the preset's, else 0
    max_new_tokens: int | None = None  # None: the preset's, else 128
    mode: str = "both"  # one of MODES
    batch_size: int = 8
    chat: bool = True  # wrap prompts in the target's chat template
    lookup: bool = False  # greedy: the draft with context lookup, as generate runs it (engine/lookup.py); refused sampled
    plot: Path | None = None  # a Figure-2-style PNG
    trace: Path | None = None  # live round traces (`trace_paths`)
    out: Path | None = None  # the document, also written here


def _check_options(spec: EvalSpec, temperature: float, live: bool) -> None:
    """The options against each other, from the arguments alone."""
    if spec.mode not in MODES:
        raise UsageError(f"unknown mode {spec.mode!r}", f"use one of {', '.join(MODES)}")
    if spec.labels and len(spec.labels) != len(spec.drafts):
        raise UsageError(f"{option('labels')} must be given once per {option('drafts')}",
                         f"give as many {option('labels')} as {option('drafts')}, in the same order, or none")
    lookup_setting(bool(spec.lookup), temperature == 0, spec.trace is not None and live)  # asked for where it cannot apply
    if spec.trace is not None and not live:
        raise UsageError(f"{option('trace')} records live rounds; {option('mode')} teacher-forced runs none",
                         f"drop {option('trace')}, or use {option('mode')} live or both")
    if len(spec.drafts) > 1:  # the labels, given or by default, known before anything loads
        names = list(spec.labels) or [(Path(d).name or d) if d else None for d in spec.drafts]
        twice = sorted({n for n in names if n is not None and names.count(n) > 1})
        if twice:
            raise UsageError(f"two drafts would both be reported as {twice[0]!r}",
                             f"name each with {option('labels')}")


def run_eval_acceptance(spec: EvalSpec, *,
                   log: Callable[[str], None] = lambda s: None,
                   note: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Check the spec (numbers, labels, every output path, prompt files) before any model loads,
    the drafts' sizes before kernel timing, then evaluate: the eval-acceptance document (also
    written to `spec.out`; the plot to `spec.plot`)."""

    preset, temperature, max_new_tokens = with_preset(spec.preset, spec.temperature, spec.max_new_tokens)
    check_positive(spec.batch_size, "batch_size")
    live = spec.mode != "teacher-forced"
    _check_options(spec, temperature, live)
    sources = spec.drafts or (None,)
    inputs = local_inputs(*spec.datasets, target=spec.target, drafts=sources)
    check_outputs([o for o in (Output(spec.out, option("out")) if spec.out else None,
                               Output(spec.plot, option("plot"), kind="figure") if spec.plot else None,
                               Output(spec.trace, option("trace")) if spec.trace else None) if o is not None], inputs)
    # prompts first: bad prompt files fail before any model loads
    texts = {ds: apply_preset_wrap(preset, ds, load_prompts(ds, spec.field, spec.limit)) for ds in spec.datasets}
    sess = open_target(spec.target, spec.device, spec.dtype, spec.revision, spec.trust_remote_code, log=log,
                       parallel=spec.target_parallel, cpu_kernels=spec.cpu_kernels, settle=False,
                       draft_weights=spec.draft_weights)
    drafts, notes = drafts_under_test(sess, sources, spec.labels, spec.revision, spec.seed)
    if spec.trace is not None and live:  # the per-pair files, checked like the trace itself
        check_outputs([Output(p, option("trace")) for p in
                       trace_paths(spec.trace, spec.datasets, [d.label for d in drafts]).values()], inputs)
    for m in notes:
        note(m)
    gamma = max(d.draft.block_size for d in drafts)
    if spec.mode != "live" and max_new_tokens <= gamma:
        raise UsageError(f"{option('max_new_tokens')} {max_new_tokens} leaves no full block of γ={gamma} to score "
                         "teacher-forced", f"use {option('max_new_tokens')} > {gamma}")
    lt = sess.target
    prompts = {ds: encode_prompts(lt.tokenizer, texts[ds], chat=spec.chat) for ds in spec.datasets}
    for ids in prompts.values():  # generate's rule: every prompt + its tokens + a block fits the positions
        check_positions(lt.model, ids, max_new_tokens, gamma)
    opts = EvalOptions(mode=spec.mode, params=SamplingParams(temperature=temperature),
                       max_new_tokens=max_new_tokens, seed=spec.seed, batch_size=spec.batch_size,
                       trace=spec.trace if live else None, preset=preset.name if preset else None,
                       lookup=spec.lookup)
    sess.settle_kernels(log, tuple(d.draft for d in drafts))  # every input is checked: the timing is not wasted
    with transaction():  # traces, figure and JSON appear together, or none (files.commit)
        results = evaluate_acceptance(lt.model, lt.name, drafts, prompts, opts, sess.stop_ids, log=log,
                                      split=sess.split)
        if spec.plot is not None:  # the writers are rank-aware: under torchrun rank 0 writes
            plot_acceptance(results, spec.plot, title=f"{lt.name}, T={temperature}")
            results["plot"] = str(spec.plot)
        if spec.out is not None:
            write_json(spec.out, results)
    return results
