"""`generate`: check every input once, open the models, settle the kernels and the policy, decode the
prompts (optionally against plain decoding of the same prompts) and return the report.

Numbers and the trace path are checked before any model loads; prompt lengths and the policy's
files before kernel timing or SPS profiling. Messages name a spec field with `errors.option`
(the CLI renders its flag).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs, local_inputs, named_inputs
from dsparkctl.checks import check_positive
from dsparkctl.data.prompts import apply_preset_wrap, encode_prompts, prompt_texts, with_preset
from dsparkctl.distributed import from_main
from dsparkctl.engine.decode import OnTokens
from dsparkctl.engine.lookup import lookup_setting
from dsparkctl.engine.policy_choice import (calibration_notes, default_policy, plan_policy, policy_notes,
                                            recording_policy)
from dsparkctl.engine.report import GenerateOptions, generate_report
from dsparkctl.engine.session import ModelSettings, open_session
from dsparkctl.engine.siblings import AUTO, parse_siblings
from dsparkctl.engine.sps_cache import machine_sps_table
from dsparkctl.errors import UsageError, option
from dsparkctl.math.policy_spec import never_drafts
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.target_checks import check_positions
from dsparkctl.provenance import provenance


@dataclass(frozen=True)
class GenerateSpec(ModelSettings):
    """Everything `generate` runs, as the user gave it (`run_generate` checks it)."""
    prompts: tuple[str, ...] = ()  # prompt texts; or prompts_file, or dataset (one source at most)
    prompts_file: Path | None = None  # .txt (one per line), .json, .jsonl, .parquet
    dataset: str | None = None  # built-in set (mt-bench, humaneval, sharegpt) or a hub dataset id
    field: str | None = None  # prompt field of a JSON/JSONL/parquet/hub set
    limit: int | None = None  # only the first N prompts
    draft: str | None = None  # folder, hub id or "random"; None: the shipped draft
    policy: str | None = None  # None: default_policy
    sps_table: Path | None = None  # None: this machine's (engine/sps_cache.py) for a policy that needs one
    calibration: Path | None = None  # None: the draft's own, when it ships one for itself
    preset: str | None = None  # data/prompts.py PRESETS
    temperature: float | None = None  # None: the preset's, else 0 (greedy)
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None  # None: the preset's, else 128
    batch_size: int = 8
    stream: bool = False  # one request at a time, its text handed to `on_text` as it arrives
    chat: bool = True  # wrap prompts in the target's chat template
    trace: Path | None = None  # per-round trace (JSON lines)
    baseline: bool = False  # also plain decoding of the same prompts
    repeats: int = 1  # timed runs of each decoder (GenerateOptions)
    siblings: str = "auto"  # greedy: x1's siblings verified beside the chain (engine/siblings.py): auto or a count
    lookup: bool | None = None  # greedy: where the context repeats itself, verify the block copied from it
                                # (engine/lookup.py). None: on where it applies (greedy, no trace, which records
                                # the draft's own rounds for calibrate and sweep-scheduler); True there refused


def _quiet(message: str) -> None:
    pass


def run_generate(spec: GenerateSpec, *,
                 log: Callable[[str], None] = _quiet, say: Callable[[str], None] = _quiet,
                 note: Callable[[str], None] = _quiet, on_progress: Callable[[int, int], None] | None = None,
                 on_text: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """Check the spec, open the models, settle kernels and policy, decode: the `generate` report.

    Every input is checked before the work that could waste it: numbers and the trace path
    before any model loads, prompt lengths and the policy's files before kernel timing or SPS
    profiling. `log` gets loading progress, `say` the slow one-time steps (kernel timing, this
    machine's SPS table), `note` what the user must be told (also kept in the report's notes),
    `on_progress(done, total)` prompts decoded, `on_text(request, new text)` the streamed text."""

    preset, temperature, max_new_tokens = with_preset(spec.preset, spec.temperature, spec.max_new_tokens)
    sampling = SamplingParams(temperature=temperature, top_k=spec.top_k, top_p=spec.top_p)
    siblings, lookup = _check_options(spec, sampling)
    texts = apply_preset_wrap(preset, spec.dataset,
                              prompt_texts(list(spec.prompts), spec.prompts_file, spec.dataset, spec.field, spec.limit,
                                           default="Write a short poem about speculative decoding."))
    named_inputs(target=spec.target, drafts=[spec.draft])  # the prompts first: a bad prompt file is named as such
    sess = open_session(spec.target, spec.draft, spec.device, spec.dtype, spec.revision, spec.trust_remote_code,
                        spec.seed, log=log, parallel=spec.target_parallel, cpu_kernels=spec.cpu_kernels, settle=False,
                        draft_weights=spec.draft_weights)
    for m in sess.notes:
        note(m)
    ids = encode_prompts(sess.target.tokenizer, texts, chat=spec.chat)
    gamma = sess.draft.block_size
    check_positions(sess.target.model, ids, max_new_tokens, gamma)
    calibration = spec.calibration
    if calibration is None and (calibration := sess.default_calibration()) is not None:
        sess.notes.append(f"confidences calibrated with {calibration} (the draft's own; a calibration given "
                          "explicitly overrides it)")
        note(sess.notes[-1])
    policy, why = (spec.policy, None) if spec.policy else \
        recording_policy(sess) if spec.trace is not None else (default_policy(sess), None)
    if why:
        sess.notes.append(why)
        note(why)
    plan = plan_policy(policy, gamma, spec.sps_table, calibration)
    cal_notes = calibration_notes(calibration, sess)
    sess.settle_kernels(say)  # every input is checked: the timing (seconds) is not wasted
    table = None
    if plan.needs_machine_table:  # this machine's table, profiled once per machine and pair (engine/sps_cache.py)
        table = from_main(lambda: machine_sps_table(sess, say, 1 if spec.stream else spec.batch_size))  # rank 0's for all
    pol = plan.build(table)
    for m in cal_notes + policy_notes(pol, sess):
        sess.notes.append(m)
        note(m)
    opts = GenerateOptions(
        sampling=sampling, max_new_tokens=max_new_tokens, batch_size=1 if spec.stream else spec.batch_size,
        seed=spec.seed, policy=pol, siblings=siblings, lookup=lookup, baseline=spec.baseline, repeats=spec.repeats, trace=spec.trace,
        trace_header=provenance(target=sess.target.name, draft=sess.draft_name, draft_fingerprint=sess.draft.fingerprint(),
                                dataset=spec.dataset or (str(spec.prompts_file) if spec.prompts_file else "args"),
                                temperature=temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                                device=str(sess.device), dtype=str(sess.dtype).replace("torch.", "")))
    on_tokens = _text_stream(sess.target.tokenizer, on_text or (lambda r, text: None)) if spec.stream else None
    progress = (lambda done, total: on_progress(len(ids) * done // total, len(ids))) if on_progress else None
    report = generate_report(sess, ids, opts, on_tokens=on_tokens, on_batch=progress)
    _as_asked(report, spec)
    if "trace_note" in report:  # a trace calibrate or sweep-scheduler cannot (fully) use: said, and kept in notes
        sess.notes.append(report["trace_note"])
        note(report["trace_note"])
    return report


def _as_asked(report: dict[str, Any], spec: GenerateSpec) -> None:
    """The report's `setting`s as the user gave them (`effective`: what ran)."""
    report["lookup"]["setting"] = "auto" if spec.lookup is None else spec.lookup
    asked = str(spec.siblings).strip().lower()
    report["siblings"]["setting"] = "auto" if asked in ("", "auto", "none") else int(asked)


def _check_options(spec: GenerateSpec, sampling: SamplingParams) -> tuple[int | str, bool]:
    """Everything the arguments alone decide, before any model loads: numbers, the options against
    each other, named files and folders, the trace path. Returns (siblings, lookup) as they will run."""
    check_positive(spec.batch_size, "batch_size")
    siblings = _siblings(spec, sampling.greedy)
    lookup = lookup_setting(spec.lookup, sampling.greedy, spec.trace is not None)
    if spec.lookup and never_drafts(spec.policy):
        raise UsageError(f"{option('lookup')} verifies blocks copied from the context; {option('policy')} static:0 "
                         "verifies none", f"drop {option('lookup')}, or choose a policy that drafts")
    if spec.trace is not None:
        check_outputs([Output(spec.trace, option("trace"))],
                      local_inputs(spec.prompts_file, spec.sps_table, spec.calibration, spec.dataset,
                                   target=spec.target, drafts=[spec.draft]))
    named_inputs(policy=spec.policy, sps_table=spec.sps_table, calibration=spec.calibration)
    return siblings, lookup


def _siblings(spec: GenerateSpec, greedy: bool) -> int | str:
    """`--siblings` checked; none with `--trace`, which records the chain alone (for calibrate and
    sweep-scheduler): auto is turned off there, and a fixed count refused."""
    siblings = parse_siblings(spec.siblings, greedy=greedy)
    if siblings not in (0, AUTO) and never_drafts(spec.policy):
        raise UsageError(f"{option('siblings')} {siblings} verifies siblings beside the draft's chain; "
                         f"{option('policy')} static:0 never drafts one", f"drop {option('siblings')}, or choose "
                         "a policy that drafts")
    if spec.trace is None or siblings == 0:
        return siblings
    if siblings != AUTO:
        raise UsageError(f"{option('trace')} records the draft's chain for calibration; siblings would mix into it",
                         f"drop {option('siblings')} (a trace runs without siblings)")
    return 0


def _text_stream(tokenizer: Any, on_text: Callable[[int, str], None]) -> OnTokens:
    """Token ids as they arrive -> `on_text(request, the text they add)` (decoded whole each time,
    so multi-token characters come out right)."""
    state: dict[int, tuple[list[int], str]] = {}

    def on_tokens(r: int, toks: list[int]) -> None:
        ids, shown = state.get(r, ([], ""))
        ids.extend(toks)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        on_text(r, text[len(shown):])
        state[r] = (ids, text)
    return on_tokens
