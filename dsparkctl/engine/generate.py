"""`generate` as one library call: `run_generate(spec)` checks every input once, opens the models,
settles the policy, decodes the prompts (optionally against plain decoding of the same prompts)
and returns the whole report.

The command builds a `GenerateSpec` from its options, calls `run_generate` and prints the report
(strict JSON with `--json`). Messages name a spec field with `errors.option` (the CLI renders its flag).
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from dsparkctl.engine.run import OnTokens, plain_decoder, run_prompts, speculative_decoder
from dsparkctl.engine.session import ModelSettings, Session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.errors import UsageError, option
from dsparkctl.math.policies import NEEDS_SPS, Policy, check_fits, parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.sps import SPSTable


DEFAULT_POLICY = "dspark"  # what won at batch 1 in benchmarks/bench_policies.py (docs/scheduling.md)


def default_policy(sess: Session) -> str:
    """The policy `generate` runs without --policy: DEFAULT_POLICY for a draft with a confidence
    head (with this machine's cached SPS table and the draft's calibration), else static:γ."""
    return DEFAULT_POLICY if sess.draft.confidence_head is not None else f"static:{sess.draft.block_size}"


def load_policy(spec: str | None, block_size: int, sps_table: Path | None, calibration: Path | None,
                sps: SPSTable | None = None, placeholder: bool = False):
    """A verify-length policy from its spec, with the SPS table (a file, or `sps` itself) and STS
    temperatures it may need. `placeholder`: check the spec and the calibration only, with a stand-in
    table (the caller builds the policy again once this machine's table exists, `machine_sps_table`)."""
    temps = prior = None
    if calibration is not None:
        from dsparkctl.calibrate import load_survival_prior, load_temperatures
        temps = load_temperatures(calibration, gamma=block_size)
        prior = load_survival_prior(calibration, block_size)
    from dsparkctl.sps_io import load_sps_table

    from dsparkctl.sps_io import check_block_size

    if sps_table is not None:
        sps = load_sps_table(sps_table)
    if placeholder and sps is None:

        sps = SPSTable([1, 2], [1.0, 1.0])  # names and arguments are checked, not costs
    if sps is not None:
        check_block_size(sps, block_size)
    return check_fits(parse_policy(spec or f"static:{block_size}", sps=sps, temperatures=temps, prior=prior),
                      block_size)


def calibration_notes(calibration: Path | None, sess: Session) -> list[str]:
    """Refuse a calibration fitted for another draft (one line); note one that does not say."""
    if calibration is None:
        return []
    from dsparkctl.calibrate import calibration_draft_notes

    return calibration_draft_notes(calibration, sess.draft.fingerprint())


def policy_notes(policy: Policy, sess: Session) -> list[str]:
    """What the user must be told about a policy's SPS table in this session: other conditions
    (machine, threads, kernels, target) than it was profiled under, or no plain-step price (so
    the policy can never skip the draft)."""
    from dsparkctl.sps_io import condition_notes

    if policy.sps is None:
        return []
    notes = condition_notes(policy.sps, sess.conditions(), target=sess.target.name)
    if hasattr(policy, "lag") and not policy.sps.has_plain:
        notes.append(f"{policy.sps.source} has no plain-step entry, so {policy.spec} can never skip the draft; "
                     "profile again with `dsparkctl profile-sps` (it times a plain step too)")
    return notes


@dataclass(frozen=True)
class GenerateOptions:
    sampling: SamplingParams
    max_new_tokens: int
    batch_size: int
    seed: int = 0
    policy: Policy | None = None  # from load_policy (inputs checked before any model work); None = static:γ
    baseline: bool = False
    repeats: int = 1  # timed runs of each decoder, interleaved; tokens/s and speedup are medians
    trace: Path | None = None
    trace_header: dict[str, Any] = field(default_factory=dict)


def warm_up(sess: Session, prompt: Sequence[int], gamma: int) -> None:
    """A few greedy tokens through both decoders (every verify width of a static:γ round, the
    one-token step), so neither timed run pays one-time costs (allocations, kernel JIT)."""
    short = list(prompt)[:8]
    SpeculativeEngine(sess.adapter, sess.draft, parse_policy(f"static:{gamma}"), SamplingParams(0.0),
                      stop_token_ids=()).generate([short], 2 * gamma + 2)
    plain_generate(sess.plain_adapter(), [short], 3, SamplingParams(0.0))


def generate_report(sess: Session, prompt_ids: Sequence[Sequence[int]], opts: GenerateOptions,
                    on_tokens: OnTokens | None = None,
                    on_batch: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Decode the prompts as `opts` says and return the report: settings, acceptance, timing,
    the baseline's when asked, and each request's text (`requests`)."""
    from dsparkctl.trace import TraceWriter

    gamma = sess.draft.block_size
    pol = opts.policy or parse_policy(f"static:{gamma}")
    engine = SpeculativeEngine(sess.adapter, sess.draft, pol, opts.sampling, stop_token_ids=sess.stop_ids)
    warm_up(sess, prompt_ids[0], gamma)
    writer = TraceWriter(opts.trace, {**opts.trace_header, "block_size": gamma, "policy": pol.spec}) \
        if opts.trace else None  # under torchrun rank 0 alone writes the merged trace (TraceWriter)
    with writer if writer else contextlib.nullcontext():
        spec = run_prompts(speculative_decoder(engine, opts.max_new_tokens), prompt_ids, opts.batch_size, opts.seed,
                           sess.device, block_size=gamma, on_round=writer.write if writer else None,
                           on_tokens=on_tokens, on_batch=on_batch, split=sess.split)
    # With repeats, the recorded run above (trace, progress, streaming) is not timed: N clean runs
    # follow, speculative and plain interleaved so drift on a busy machine hits both alike.
    spec_tps = [] if opts.repeats > 1 else [spec.generated / spec.wall_s]
    plain_tps: list[float] = []
    plain = None
    spec_decode = speculative_decoder(engine, opts.max_new_tokens)
    plain_decode = plain_decoder(sess.plain_adapter(), opts.max_new_tokens, opts.sampling, sess.stop_ids) \
        if opts.baseline else None
    for _ in range(opts.repeats):
        if len(spec_tps) < opts.repeats:
            again = run_prompts(spec_decode, prompt_ids, opts.batch_size, opts.seed, sess.device, block_size=gamma,
                                split=sess.split)
            spec_tps.append(again.generated / again.wall_s)
        if plain_decode is not None:
            p = run_prompts(plain_decode, prompt_ids, opts.batch_size, opts.seed, sess.device, split=sess.split)
            plain_tps.append(p.generated / p.wall_s)
            plain = plain or p
    stats = spec.stats
    report: dict[str, Any] = {
        "target": sess.target.name, "draft": sess.draft_name, "draft_kind": sess.draft.cfg.kind,
        "block_size": gamma, "policy": pol.spec, "device": str(sess.device),
        "dtype": str(sess.dtype).replace("torch.", ""), "cpu_kernels": sess.cpu_kernels,
        "sampling": {"temperature": opts.sampling.temperature, "top_p": opts.sampling.top_p,
                     "top_k": opts.sampling.top_k, "seed": opts.seed},
        "prompts": len(prompt_ids), "batch_size": opts.batch_size, "max_new_tokens": opts.max_new_tokens,
        "generated_tokens": spec.generated, "wall_s": spec.wall_s, "repeats": opts.repeats,
        "tokens_per_s": statistics.median(spec_tps), "tokens_per_s_runs": spec_tps,
        "acceptance": stats.to_json(), "conditional_interval": stats.conditional_interval(),
        "survival_interval": stats.survival_interval(), "timing_ms": spec.times_ms, "engine_steps": spec.rounds,
        "drafted_steps": spec.drafted_steps, "notes": sess.notes,
    }
    if (why := scheduler_note(pol, spec.drafted_steps, spec.rounds, min(opts.batch_size, len(prompt_ids)),
                              gamma)) is not None:
        report["scheduler_note"] = why
    if opts.trace:
        report["trace"] = str(opts.trace)
    if spec.rounds:
        per = {k: v / spec.rounds for k, v in spec.times_ms.items() if k in ("draft", "verify", "schedule", "accept")}
        per["overhead"] = per.get("schedule", 0.0) + per.get("accept", 0.0)
        report["per_step_ms"] = per
        round_ms = per.get("draft", 0.0) + per.get("verify", 0.0) + per["overhead"]
        report["draft_share_of_round"] = per.get("draft", 0.0) / round_ms if round_ms > 0 else None
    if plain is not None:
        report["baseline"] = {"generated_tokens": plain.generated, "wall_s": plain.wall_s,
                              "tokens_per_s": statistics.median(plain_tps), "tokens_per_s_runs": plain_tps}
        report["speedup"] = statistics.median([a / b for a, b in zip(spec_tps, plain_tps)])  # of paired runs
        if opts.sampling.greedy:
            report["baseline"]["identical_outputs"] = sum(
                a.tokens == b.tokens for a, b in zip(spec.outputs, plain.outputs))
    decode = sess.target.tokenizer.decode
    report["requests"] = [{"index": i, "text": decode(o.tokens, skip_special_tokens=True),
                           "generated_tokens": len(o.tokens), "finish_reason": o.finish_reason, "rounds": o.rounds}
                          for i, o in enumerate(spec.outputs)]
    return report


RARELY = 0.25  # a policy that drafted in fewer of the steps than this is said to have drafted rarely


def scheduler_note(pol: Policy, drafted: int, steps: int, requests: int, gamma: int) -> str | None:
    """Why a policy that may skip the draft drafted in few of the steps, from the step costs it
    planned with; None when it drafted in most steps (or cannot skip)."""
    sps = pol.sps
    if not steps or drafted >= RARELY * steps or sps is None or not sps.has_plain:
        return None
    import torch

    plain = sps.plain_seconds(requests) * 1000
    one = float(sps.step_seconds(requests, torch.tensor([2.0 * requests]))[0]) * 1000
    full = float(sps.step_seconds(requests, torch.tensor([(gamma + 1.0) * requests]))[0]) * 1000
    how = "never drafted" if drafted == 0 else f"drafted in {drafted} of {steps} steps"
    return (f"the scheduler {how}: at {requests} request(s) a plain step costs {plain:.1f} ms, a round verifying "
            f"1 draft {one:.1f} ms ({one / plain:.2f}x) and {gamma} drafts {full:.1f} ms ({full / plain:.2f}x), so "
            f"a round pays only where the draft's calibrated confidences promise more than that many tokens, and "
            f"they seldom did; the speedup below is the scheduler's choice against plain decoding, not what "
            f"drafting every step would give (policy static:2 drafts every step)")


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
    from dsparkctl.checks import Output, check_outputs, check_positive, local_inputs
    from dsparkctl.data.prompts import apply_preset_wrap, encode_prompts, prompt_texts, with_preset
    from dsparkctl.engine.session import open_session
    from dsparkctl.provenance import provenance

    preset, temperature, max_new_tokens = with_preset(spec.preset, spec.temperature, spec.max_new_tokens)
    sampling = SamplingParams(temperature=temperature, top_k=spec.top_k, top_p=spec.top_p)
    check_positive(spec.batch_size, "batch_size")
    if spec.trace is not None:
        check_outputs([Output(spec.trace, option("trace"))],
                      local_inputs(spec.prompts_file, spec.sps_table, spec.calibration, spec.dataset,
                                   target=spec.target, drafts=[spec.draft]))
    texts = apply_preset_wrap(preset, spec.dataset,
                              prompt_texts(list(spec.prompts), spec.prompts_file, spec.dataset, spec.field, spec.limit,
                                           default="Write a short poem about speculative decoding."))
    sess = open_session(spec.target, spec.draft, spec.device, spec.dtype, spec.revision, spec.trust_remote_code,
                        spec.seed, log=log, parallel=spec.target_parallel, cpu_kernels=spec.cpu_kernels, settle=False)
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
    policy = spec.policy or default_policy(sess)
    machine_table = policy.partition(":")[0].strip() in NEEDS_SPS and spec.sps_table is None
    pol = load_policy(policy, gamma, spec.sps_table, calibration, placeholder=machine_table)
    cal_notes = calibration_notes(calibration, sess)
    sess.settle_kernels(say)  # every input is checked: the timing (seconds) is not wasted
    if machine_table:  # this machine's table, profiled once per machine and pair (engine/sps_cache.py)
        from dsparkctl.distributed import from_main
        from dsparkctl.engine.sps_cache import machine_sps_table

        table = from_main(lambda: machine_sps_table(sess, say, 1 if spec.stream else spec.batch_size))  # rank 0's for all
        pol = load_policy(policy, gamma, None, calibration, sps=table)
    for m in cal_notes + policy_notes(pol, sess):
        sess.notes.append(m)
        note(m)
    opts = GenerateOptions(
        sampling=sampling, max_new_tokens=max_new_tokens, batch_size=1 if spec.stream else spec.batch_size,
        seed=spec.seed, policy=pol, baseline=spec.baseline, repeats=spec.repeats, trace=spec.trace,
        trace_header=provenance(target=sess.target.name, draft=sess.draft_name, draft_fingerprint=sess.draft.fingerprint(),
                                dataset=spec.dataset or (str(spec.prompts_file) if spec.prompts_file else "args"),
                                temperature=temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                                device=str(sess.device), dtype=str(sess.dtype).replace("torch.", "")))
    on_tokens = _text_stream(sess.target.tokenizer, on_text or (lambda r, text: None)) if spec.stream else None
    progress = (lambda done, total: on_progress(len(ids) * done // total, len(ids))) if on_progress else None
    return generate_report(sess, ids, opts, on_tokens=on_tokens, on_batch=progress)


def check_positions(model: Any, ids: Sequence[Sequence[int]], max_new_tokens: int, block_size: int) -> None:
    """Refuse prompts that would run past the model's positions before any generation starts."""
    from dsparkctl.engine.profile import position_limit

    limit = position_limit(model)
    longest = max(len(p) for p in ids)
    name = option("max_new_tokens")
    if limit is not None and longest + max_new_tokens + block_size + 1 > limit:
        raise UsageError(f"the longest prompt ({longest} tokens) + {name} {max_new_tokens} runs past "
                         f"the target's {limit} positions (max_position_embeddings)",
                         f"shorten the prompt or use {name} ≤ {max(1, limit - longest - block_size - 1)}")


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
