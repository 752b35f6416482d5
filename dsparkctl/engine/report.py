"""The `generate` report: decode prompts with a session's engine (the recorded run: trace, progress,
streaming), time it against plain decoding when asked, and gather settings, acceptance, timing and
each request's text.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from dsparkctl.engine.decode import OnTokens, PromptsResult, plain_decoder, run_prompts, speculative_decoder
from dsparkctl.engine.policy_choice import scheduler_note, trace_note
from dsparkctl.engine.session import Session
from dsparkctl.engine.speculative import SpeculativeEngine, plain_generate
from dsparkctl.formats.trace import TraceWriter
from dsparkctl.math.policies import Policy
from dsparkctl.math.policy_spec import parse_policy
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.math.stats import acceptance_intervals


@dataclass(frozen=True)
class GenerateOptions:
    sampling: SamplingParams
    max_new_tokens: int
    batch_size: int
    seed: int = 0
    policy: Policy | None = None  # from load_policy (inputs checked before any model work); None = static:γ
    siblings: int | str = 0  # greedy: siblings of x1 verified beside the chain (engine/siblings.py), or "auto"
    lookup: bool = False  # greedy: a block copied from the context where it repeats itself (engine/lookup.py)
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
    gamma = sess.draft.block_size
    pol = opts.policy or parse_policy(f"static:{gamma}")
    engine = SpeculativeEngine(sess.adapter, sess.draft, pol, opts.sampling, stop_token_ids=sess.stop_ids,
                               siblings=opts.siblings, lookup=opts.lookup)
    warm_up(sess, prompt_ids[0], gamma)
    header = {**opts.trace_header, "block_size": gamma, "policy": pol.spec, "max_new_tokens": opts.max_new_tokens,
              "batch_size": opts.batch_size}
    writer = TraceWriter(opts.trace, header) if opts.trace else None  # under torchrun rank 0 alone writes it
    with writer if writer else contextlib.nullcontext():
        spec = run_prompts(speculative_decoder(engine, opts.max_new_tokens), prompt_ids, opts.batch_size, opts.seed,
                           sess.device, block_size=gamma, on_round=writer.write if writer else None,
                           on_tokens=on_tokens, on_batch=on_batch, split=sess.split)
    spec_tps, plain_tps, plain = _timed_runs(sess, engine, prompt_ids, opts, spec)
    report = _settings(sess, pol, prompt_ids, opts) | _acceptance(spec, spec_tps, opts, engine)
    report["notes"] = sess.notes
    if (why := scheduler_note(pol, spec.drafted_steps, spec.rounds, min(opts.batch_size, len(prompt_ids)),
                              gamma)) is not None:
        report["scheduler_note"] = why
    if writer is not None:
        report["trace"] = str(opts.trace)
        if (why := trace_note(writer.counts, header, opts.trace)) is not None:
            report["trace_note"] = why
    report |= _per_step(spec)
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


def _timed_runs(sess: Session, engine: SpeculativeEngine, prompt_ids: Sequence[Sequence[int]], opts: GenerateOptions,
                recorded: PromptsResult) -> tuple[list[float], list[float], PromptsResult | None]:
    """Tokens/s of the speculative decoder and of plain decoding (with a baseline), and the first
    plain run. With repeats the recorded run (trace, progress, streaming) is not timed: N clean
    runs follow, speculative and plain interleaved so drift on a busy machine hits both alike.
    Under torchrun both time the whole job (every rank its share at once, the slowest rank's wall:
    `decode._merge`), so the ratio compares like with like; a one-process figure is profile-sps's,
    which refuses torchrun (`distributed.one_process`)."""
    gamma = sess.draft.block_size
    spec_tps = [] if opts.repeats > 1 else [recorded.generated / recorded.wall_s]
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
    return spec_tps, plain_tps, plain


def _settings(sess: Session, pol: Policy, prompt_ids: Sequence[Sequence[int]], opts: GenerateOptions) -> dict[str, Any]:
    return {"target": sess.target.name, "draft": sess.draft_name, "draft_kind": sess.draft.cfg.kind,
            "block_size": sess.draft.block_size, "policy": pol.spec, "device": str(sess.device),
            "dtype": str(sess.dtype).replace("torch.", ""), "cpu_kernels": sess.cpu_kernels,
            "draft_weights": sess.draft_precision,
            "sampling": {"temperature": opts.sampling.temperature, "top_p": opts.sampling.top_p,
                         "top_k": opts.sampling.top_k, "seed": opts.seed},
            "prompts": len(prompt_ids), "batch_size": opts.batch_size, "max_new_tokens": opts.max_new_tokens}


def _acceptance(spec: PromptsResult, spec_tps: list[float], opts: GenerateOptions,
                engine: SpeculativeEngine) -> dict[str, Any]:
    """The speculative run's counts, each proposer's acceptance apart (engine/rounds.py: `acceptance`
    is the draft's own chain), the engine's τ over them all, and timing."""
    streams = spec.streams
    stats = streams.draft
    out: dict[str, Any] = {
        "generated_tokens": spec.generated, "wall_s": spec.wall_s, "repeats": opts.repeats,
        "tokens_per_s": statistics.median(spec_tps), "tokens_per_s_runs": spec_tps,
        "acceptance": stats.to_json(),
        **acceptance_intervals(stats, [o.draft for o in spec.outputs if o is not None and o.draft is not None]),
        "engine": streams.engine_json(),
        "timing_ms": spec.times_ms, "engine_steps": spec.rounds, "drafted_steps": spec.drafted_steps,
        "siblings": {"setting": opts.siblings, "effective": engine.effective_siblings,
                     **streams.siblings_json()},
        "lookup": {"setting": opts.lookup, "effective": engine.lookup, "rows_verified_with": streams.lookup.rounds,
                   "acceptance": streams.lookup.to_json() if streams.lookup.rounds else None}}
    return out


def _per_step(spec: PromptsResult) -> dict[str, Any]:
    """Time per engine step by stage, and the draft's share of a round (none without steps)."""
    if not spec.rounds:
        return {}
    per = {k: v / spec.rounds for k, v in spec.times_ms.items() if k in ("draft", "verify", "schedule", "accept")}
    per["overhead"] = per.get("schedule", 0.0) + per.get("accept", 0.0)
    round_ms = per.get("draft", 0.0) + per.get("verify", 0.0) + per["overhead"]
    return {"per_step_ms": per, "draft_share_of_round": per.get("draft", 0.0) / round_ms if round_ms > 0 else None}
