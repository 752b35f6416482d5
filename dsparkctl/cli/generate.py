"""`dsparkctl generate`: lossless speculative generation with a DSpark/DFlash draft."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from dsparkctl.cli.common import (CpuKernels, CpuKernelsOpt, DeviceOpt, DraftOpt, DType, DTypeOpt, Device, JsonOpt, RevisionOpt, SeedOpt,
                                  MaxNewTokensOpt, PresetOpt, TargetOpt, TargetParallelOpt, TemperatureOpt, TrustRemoteCodeOpt, err,
                                  guarded, out, print_json, progress_bar, show_progress, styled, with_preset)
from dsparkctl.errors import UsageError
from dsparkctl.math.policies import NEEDS_SPS, POLICY_SPECS


def register(app: typer.Typer) -> None:
    app.command("generate", help="Speculative generation: draft → schedule → verify, batched; "
                "prints text, τ and per-position acceptance.")(generate)


def acceptance_table(stats: Any, title: str) -> Table:
    """Per-position conditional acceptance and survival with 95% Wilson intervals."""
    t = Table(title=title, title_justify="left")
    for col in ("position", "reached", "accepted", "conditional c_j [95% CI]", "survival a_j [95% CI]"):
        t.add_column(col, justify="right")
    cond, surv = stats.conditional(), stats.survival()
    ci_c, ci_s = stats.conditional_interval(), stats.survival_interval()
    for j in range(stats.block_size):
        def fmt(v, ci):
            return "-" if v is None else f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        t.add_row(str(j + 1), str(stats.reached[j]), str(stats.accepted_at[j]), fmt(cond[j], ci_c[j]),
                  fmt(surv[j], ci_s[j]))
    return t


@guarded
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompt texts (or use --prompts-file/--dataset).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="Prompts: .txt (one per line), .json, .jsonl, .parquet.")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Built-in prompt set (mt-bench, humaneval, sharegpt) or a hub dataset id.")] = None,
    field: Annotated[Optional[str], typer.Option("--field", help="Prompt field in a JSON/JSONL/parquet/hub dataset.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Use only the first N prompts.")] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    revision: RevisionOpt = None,
    policy: Annotated[Optional[str], typer.Option("--policy", help=f"Verify-length policy: {POLICY_SPECS} (default "
                                                  "dspark, with this machine's SPS table and the draft's own "
                                                  "calibration; static:γ for a draft without a confidence head; "
                                                  "static:0 is plain decoding; retrospective is biased: for replay "
                                                  "studies only).")] = None,
    sps_table: Annotated[Optional[Path], typer.Option("--sps-table", help=f"SPS table for {', '.join(NEEDS_SPS)} "
                                                      "(from profile-sps); default: this machine's, profiled once "
                                                      "and cached.")] = None,
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="Per-position temperatures from `dsparkctl calibrate`.")] = None,
    temperature: TemperatureOpt = None,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling (0 = off).")] = 0,
    max_new_tokens: MaxNewTokensOpt = None,
    preset: PresetOpt = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Requests decoded together.")] = 8,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    seed: SeedOpt = 0,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it is generated (one request at a time).")] = False,
    json_out: JsonOpt = False,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write a per-round trace (JSON lines) for calibrate/sweep-scheduler.")] = None,
    baseline: Annotated[bool, typer.Option("--baseline", help="Also run plain target decoding on the same prompts; report tokens/s of both and the ratio.")] = False,
    repeats: Annotated[int, typer.Option("--repeats", min=1, max=100, help="Time the decoding this many times "
                                         "(with --baseline interleaved: speculative, plain, speculative, ...); "
                                         "tokens/s and the speedup are medians. With N > 1, text, τ and the trace "
                                         "come from one more, untimed run.")] = 1,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap prompts in the target's chat template.")] = True,
    show_text: Annotated[bool, typer.Option("--text/--no-text", help="Print the generated text.")] = True,
    trust_remote_code: TrustRemoteCodeOpt = False,
    target_parallel: TargetParallelOpt = "none",
    cpu_kernels: CpuKernelsOpt = CpuKernels.auto,
) -> None:
    from dsparkctl.cli.checks import Output, check_outputs, local_inputs
    from dsparkctl.data.prompts import apply_preset_wrap, encode_prompts, prompt_texts
    from dsparkctl.engine.generate import (GenerateOptions, calibration_notes, default_policy, generate_report,
                                           load_policy, policy_notes)
    from dsparkctl.engine.session import open_session
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.provenance import provenance

    preset, temperature, max_new_tokens = with_preset(preset, temperature, max_new_tokens)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if trace is not None:
        check_outputs([Output(trace, "--trace")], local_inputs(prompts_file, sps_table, calibration, dataset,
                                                               target=target, drafts=[draft]))
    texts = apply_preset_wrap(preset, dataset, prompt_texts(prompts, prompts_file, dataset, field, limit,
                                                            default="Write a short poem about speculative decoding."))
    log = (lambda m: err.print(styled((m, "dim")))) if not json_out or show_progress() else (lambda m: None)
    sess = open_session(target, draft, device.value, dtype.value, revision, trust_remote_code, seed, log=log,
                        parallel=target_parallel, cpu_kernels=cpu_kernels.value, settle=False)
    for n in sess.notes:
        err.print(styled(("note:", "yellow"), f" {n}"))
    tok = sess.target.tokenizer
    ids = encode_prompts(tok, texts, chat=chat)
    check_positions(sess.target.model, ids, max_new_tokens, sess.draft.block_size)
    if calibration is None and (calibration := sess.default_calibration()) is not None:
        sess.notes.append(f"confidences calibrated with {calibration} (the draft's own; --calibration to override)")
        err.print(styled(("note:", "yellow"), f" {sess.notes[-1]}"))
    policy = policy or default_policy(sess)
    machine_table = policy.partition(":")[0].strip() in NEEDS_SPS and sps_table is None
    pol = load_policy(policy, sess.draft.block_size, sps_table, calibration, placeholder=machine_table)
    cal_notes = calibration_notes(calibration, sess)
    sess.settle_kernels(lambda m: err.print(styled((m, "dim"))))  # said even under --json: it takes seconds
    if machine_table:  # this machine's table, profiled once per machine and pair (engine/sps_cache.py)
        from dsparkctl.engine.sps_cache import machine_sps_table

        from dsparkctl.distributed import all_gather, world

        table = machine_sps_table(sess, lambda m: err.print(styled((m, "dim")))) if world().main else None
        table = all_gather(table)[0]  # under torchrun every rank plans with rank 0's table
        pol = load_policy(policy, sess.draft.block_size, None, calibration, sps=table)
    for n in cal_notes + policy_notes(pol, sess):
        sess.notes.append(n)
        err.print(styled(("note:", "yellow"), f" {n}"))
    opts = GenerateOptions(
        sampling=sampling, max_new_tokens=max_new_tokens, batch_size=1 if stream else batch_size, seed=seed,
        policy=pol, baseline=baseline, repeats=repeats, trace=trace,
        trace_header=provenance(target=sess.target.name, draft=sess.draft_name, draft_fingerprint=sess.draft.fingerprint(),
                                dataset=dataset or (str(prompts_file) if prompts_file else "args"),
                                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                device=str(sess.device), dtype=str(sess.dtype).replace("torch.", "")))
    on_tokens = _streamer(tok) if stream else None
    with progress_bar("generate", len(ids), unit="prompts", enabled=not stream) as advance:
        res = generate_report(sess, ids, opts, on_tokens=on_tokens,
                              on_batch=lambda done, total: advance(len(ids) * done // total))
    report, results = res.report, res.speculative.outputs
    texts_out = [tok.decode(o.tokens, skip_special_tokens=True) for o in results]
    if json_out:
        report["requests"] = [{"index": i, "text": t, "generated_tokens": len(o.tokens),
                               "finish_reason": o.finish_reason, "rounds": o.rounds}
                              for i, (t, o) in enumerate(zip(texts_out, results))]
        print_json(report)
        return
    if show_text and not stream:
        for i, t in enumerate(texts_out):
            out.print(styled((f"── prompt {i + 1}", "bold"), " ", (f"({len(results[i].tokens)} tokens, "
                                                                   f"{results[i].finish_reason})", "dim")))
            out.print(t, highlight=False)
    out.print(summary_table(report))
    out.print(acceptance_table(res.speculative.stats, "per-position acceptance (conditional = accepted/reached; "
                                                      "survival = P(first j accepted))"))


def check_positions(model: Any, ids: list[list[int]], max_new_tokens: int, block_size: int) -> None:
    """Refuse prompts that would run past the model's positions before any generation starts."""
    from dsparkctl.engine.profile import position_limit

    limit = position_limit(model)
    longest = max(len(p) for p in ids)
    if limit is not None and longest + max_new_tokens + block_size + 1 > limit:
        raise UsageError(f"the longest prompt ({longest} tokens) + --max-new-tokens {max_new_tokens} runs past "
                         f"the target's {limit} positions (max_position_embeddings)",
                         f"shorten the prompt or use --max-new-tokens ≤ {max(1, limit - longest - block_size - 1)}")


def _streamer(tok: Any):
    """Print each request's text as its tokens arrive (batch size 1)."""
    state: dict[int, tuple[list[int], str]] = {}

    def on_tokens(r: int, toks: list[int]) -> None:
        if r not in state:
            out.print(styled((f"── prompt {r + 1}", "bold")))
            state[r] = ([], "")
        ids, shown = state[r]
        ids.extend(toks)
        text = tok.decode(ids, skip_special_tokens=True)
        out.print(text[len(shown):], end="", highlight=False)
        state[r] = (ids, text)
    return on_tokens


def summary_table(report: dict[str, Any]) -> Table:
    acc = report["acceptance"]
    s = report["sampling"]
    t = Table(title=f"{report['draft']} ({report['draft_kind']}, γ={report['block_size']}) on {report['target']} · "
              f"policy {report['policy']} · T={s['temperature']}", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    tau = acc["tau"]
    t.add_row("τ (tokens per round, bonus included)", f"{tau:.3f}" if tau else "-")
    for key, label in (("draft_acceptance_rate", "draft acceptance rate (vLLM)"),
                       ("verify_rate", "verify rate (DeepSpec)")):
        if acc.get(key) is not None:
            t.add_row(label, f"{100 * acc[key]:.1f}%")
    t.add_row("rounds / engine steps", f"{acc['rounds']} / {report['engine_steps']}")
    t.add_row("generated tokens", str(report["generated_tokens"]))
    runs = f" (median of {report['repeats']})" if report.get("repeats", 1) > 1 else ""
    t.add_row(f"speculative tokens/s{runs}", f"{report['tokens_per_s']:.1f}")
    if "per_step_ms" in report:
        p = report["per_step_ms"]
        t.add_row("per step: draft / verify / overhead ms",
                  f"{p.get('draft', 0):.1f} / {p.get('verify', 0):.1f} / {p['overhead']:.1f}")
    if "baseline" in report:
        b = report["baseline"]
        t.add_row(f"plain target tokens/s{runs}", f"{b['tokens_per_s']:.1f}")
        t.add_row(f"speedup (speculative / plain){' (median of paired runs)' if runs else ''}",
                  f"{report['speedup']:.2f}×")
        if "identical_outputs" in b:
            t.add_row("greedy outputs identical to plain", f"{b['identical_outputs']}/{report['prompts']}")
    return t
