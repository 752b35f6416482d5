"""`generate` as one library call: speculative decoding of a prompt list, optionally against plain
decoding of the same prompts, as one report.

The command only validates its options, opens a session (engine/session.py), calls
`generate_report` and prints. The report is plain data (strict JSON once written).
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from dsparkctl.engine.run import (OnTokens, PromptsResult, plain_decoder, run_prompts, speculative_decoder)
from dsparkctl.engine.session import Session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.math.policies import Policy, check_fits, parse_policy
from dsparkctl.math.sampling import SamplingParams


DEFAULT_POLICY = "dspark"  # what won at batch 1 in benchmarks/bench_policies.py (docs/scheduling.md)


def default_policy(sess: Session) -> str:
    """The policy `generate` runs without --policy: DEFAULT_POLICY for a draft with a confidence
    head (with this machine's cached SPS table and the draft's calibration), else static:γ."""
    return DEFAULT_POLICY if sess.draft.confidence_head is not None else f"static:{sess.draft.block_size}"


def load_policy(spec: str | None, block_size: int, sps_table: Path | None, calibration: Path | None,
                sps: "SPSTable | None" = None, placeholder: bool = False):
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
        from dsparkctl.math.sps import SPSTable

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


@dataclass
class GenerateResult:
    report: dict[str, Any]
    speculative: PromptsResult
    plain: PromptsResult | None


def warm_up(sess: Session, prompt: Sequence[int], gamma: int) -> None:
    """A few greedy tokens through both decoders (every verify width of a static:γ round, the
    one-token step), so neither timed run pays one-time costs (allocations, kernel JIT)."""
    short = list(prompt)[:8]
    SpeculativeEngine(sess.adapter, sess.draft, parse_policy(f"static:{gamma}"), SamplingParams(0.0),
                      stop_token_ids=()).generate([short], 2 * gamma + 2)
    plain_generate(sess.plain_adapter(), [short], 3, SamplingParams(0.0))


def generate_report(sess: Session, prompt_ids: Sequence[Sequence[int]], opts: GenerateOptions,
                    on_tokens: OnTokens | None = None,
                    on_batch: Callable[[int, int], None] | None = None) -> GenerateResult:
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
        "notes": sess.notes,
    }
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
    return GenerateResult(report=report, speculative=spec, plain=plain)
