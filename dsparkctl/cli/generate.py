"""`dsparkctl generate`: lossless speculative generation with a DSpark/DFlash draft."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from dsparkctl.cli.console import err, note, out, print_json, progress_bar, show_progress, styled
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import (CpuKernels, CpuKernelsOpt, DraftWeights, DraftWeightsOpt, Device, DeviceOpt, DraftOpt, DType, DTypeOpt, JsonOpt,
                                   MaxNewTokensOpt, PresetOpt, RevisionOpt, SeedOpt, TargetOpt, TargetParallelOpt,
                                   TemperatureOpt, TrustRemoteCodeOpt)
from dsparkctl.math.policy_spec import NEEDS_SPS, POLICY_SPECS


def register(app: typer.Typer) -> None:
    app.command("generate", help="Generate text with speculative decoding (the draft proposes, the target "
                "verifies; the output is the target's); prints the text, τ and acceptance per draft position.")(generate)


def acceptance_table(report: dict[str, Any], title: str) -> Table:
    """Per-position conditional acceptance and survival with 95% Wilson intervals."""
    t = Table(title=title, title_justify="left")
    unit = (f"over {report['interval_units']} prompts" if report.get("interval_unit") == "prompt" else
            "over rounds, counted as independent")
    for col in ("position", "reached", "accepted", f"conditional c_j [95% CI {unit}]", f"survival a_j [95% CI {unit}]"):
        t.add_column(col, justify="right")
    acc = report["acceptance"]
    cond, surv = acc["conditional"], acc["survival"]
    ci_c, ci_s = report["conditional_interval"], report["survival_interval"]
    for j in range(acc["block_size"]):
        def fmt(v, ci):
            return "-" if v is None else f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        t.add_row(str(j + 1), str(acc["reached"][j]), str(acc["accepted_at"][j]), fmt(cond[j], ci_c[j]),
                  fmt(surv[j], ci_s[j]))
    return t


@guarded
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompt texts, each quoted (or use --prompts-file or "
                                                                  "--dataset).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="Prompts: .txt (one per line), .json, .jsonl, .parquet.")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Prompt set: mt-bench, humaneval, sharegpt or a hub dataset id.")] = None,
    field: Annotated[Optional[str], typer.Option("--field", help="Which field holds the prompt in a JSON/JSONL/parquet file or hub dataset.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Use only the first N prompts.")] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    revision: RevisionOpt = None,
    policy: Annotated[Optional[str], typer.Option("--policy", help=f"How many drafted tokens each round verifies: "
                                                  f"{POLICY_SPECS}. Default: dspark (static:γ for a draft without a "
                                                  "confidence head, or with --trace); static:0 = plain decoding; "
                                                  "retrospective is biased, for replay studies only.")] = None,
    sps_table: Annotated[Optional[Path], typer.Option("--sps-table", help=f"Steps-per-second table from profile-sps, "
                                                      f"for {', '.join(NEEDS_SPS)} (default: this machine's, "
                                                      "profiled once and cached).")] = None,
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="Calibration JSON from `dsparkctl "
                                                        "calibrate` (default: the draft's own, if it has one).")] = None,
    temperature: TemperatureOpt = None,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Top-k sampling (0 = off).")] = 0,
    max_new_tokens: MaxNewTokensOpt = None,
    preset: PresetOpt = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Requests decoded together (default: 8; "
                                                      "--stream decodes one at a time).", show_default=False)] = None,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    seed: SeedOpt = 0,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it is generated (one request at a time).")] = False,
    json_out: JsonOpt = False,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write a per-round trace (JSON lines) for calibrate "
                                                 "and sweep-scheduler (without --policy, each round verifies every "
                                                 "drafted token, as they need).")] = None,
    baseline: Annotated[bool, typer.Option("--baseline", help="Also run plain target decoding on the same prompts; report tokens/s of both and the ratio.")] = False,
    repeats: Annotated[int, typer.Option("--repeats", min=1, max=100, help="Time the decoding this many times "
                                         "(alternating with --baseline) and report medians; text, τ and the trace "
                                         "then come from one more, untimed run.")] = 1,
    siblings: Annotated[str, typer.Option("--siblings", help="Greedy only: also verify the draft's runner-up tokens "
                                          "for the first drafted position, in the same forward: auto = as many as "
                                          "the SPS table says pay off, a number = that many, 0 = off.")] = "auto",
    lookup: Annotated[Optional[bool], typer.Option("--lookup/--no-lookup", help="Greedy only: where the text repeats "
                                                   "its last 2-4 tokens, verify what followed them before instead of "
                                                   "the draft's block. Default: on for greedy decoding without --trace; "
                                                   "refused with sampling or --trace.",
                                                   show_default=False)] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap prompts in the target's chat template.")] = True,
    show_text: Annotated[bool, typer.Option("--text/--no-text", help="Print the generated text.")] = True,
    trust_remote_code: TrustRemoteCodeOpt = False,
    target_parallel: TargetParallelOpt = "none",
    cpu_kernels: CpuKernelsOpt = CpuKernels.auto,
    draft_weights: DraftWeightsOpt = DraftWeights.auto,
) -> None:
    from dsparkctl.app.generate import GenerateSpec, run_generate
    from dsparkctl.errors import UsageError

    if stream and json_out:
        raise UsageError("--stream prints the text as it comes and --json one document, both on stdout",
                         "drop one of them (--json holds every request's text)")
    if stream and (batch_size not in (None, 1) or not show_text):
        what = f"--batch-size {batch_size}" if batch_size not in (None, 1) else "--no-text"
        raise UsageError(f"--stream prints each request's text as it is generated, one request at a time; {what} "
                         "contradicts it", f"drop {what} or --stream")
    batch_size = 8 if batch_size is None else batch_size

    spec = GenerateSpec(
        prompts=tuple(prompts or ()), prompts_file=prompts_file, dataset=dataset, field=field, limit=limit,
        target=target, draft=draft, revision=revision, trust_remote_code=trust_remote_code,
        target_parallel=target_parallel, device=device.value, dtype=dtype.value, cpu_kernels=cpu_kernels.value, draft_weights=draft_weights.value,
        policy=policy, sps_table=sps_table, calibration=calibration, preset=preset, temperature=temperature,
        top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, stream=stream,
        chat=chat, trace=trace, baseline=baseline, repeats=repeats, siblings=siblings, lookup=lookup)
    show = lambda m: err.print(styled((m, "dim")))  # noqa: E731
    with progress_bar("generate", None, unit="prompts", enabled=not stream) as update:
        report = run_generate(spec, log=show if not json_out or show_progress() else lambda m: None,
                              say=show,  # said even under --json: kernel timing and SPS profiling take seconds
                              note=note,
                              on_progress=lambda done, total: update(completed=done, total=total),
                              on_text=_stream_printer() if stream else None)
    if json_out:
        print_json(report)
    else:
        if stream:
            out.print()  # the streamed text ends its line before the report
        print_report(report, texts=show_text and not stream)



def print_report(report: dict[str, Any], texts: bool) -> None:
    """The human view: each request's text (when `texts`), the summary and the acceptance table."""
    if texts:
        for r in report["requests"]:
            out.print(styled((f"── prompt {r['index'] + 1}", "bold"), " ",
                             (f"({r['generated_tokens']} tokens, {r['finish_reason']})", "dim")))
            out.print(r["text"], highlight=False)
    out.print(summary_table(report))
    if "scheduler_note" in report:
        out.print(styled(("note: ", "yellow"), (report["scheduler_note"], "")))
    out.print(acceptance_table(report, "the draft's per-position acceptance: its chain only, without siblings or "
                                       "copied blocks (conditional = accepted/reached; survival = P(first j accepted))"))


def _stream_printer():
    """Print each request's text as it arrives (a heading before its first piece)."""
    started: set[int] = set()

    def on_text(r: int, text: str) -> None:
        if r not in started:
            if started:
                out.print()  # the previous request's text ends its line
            out.print(styled((f"── prompt {r + 1}", "bold")))
            started.add(r)
        out.print(text, end="", highlight=False)
    return on_text


def summary_table(report: dict[str, Any]) -> Table:
    acc = report["acceptance"]
    s = report["sampling"]
    t = Table(title=f"{report['draft']} ({report['draft_kind']}, γ={report['block_size']}) on {report['target']} · "
              f"policy {report['policy']} · T={s['temperature']}", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    eng = report.get("engine") or {}
    if eng.get("tau") is not None:
        t.add_row("engine τ (tokens per speculative round, every proposer)", f"{eng['tau']:.3f}")
    tau = acc["tau"]
    t.add_row("the draft's τ (its chain's tokens per round it verified)", f"{tau:.3f}" if tau else "-")
    for key, label in (("draft_acceptance_rate", "the draft's acceptance rate (vLLM)"),
                       ("verify_rate", "the draft's verify rate (DeepSpec)")):
        if acc.get(key) is not None:
            t.add_row(label, f"{100 * acc[key]:.1f}%")
    t.add_row("rounds verifying the draft / engine steps", f"{acc['rounds']} / {report['engine_steps']}")
    if "drafted_steps" in report:
        t.add_row("engine steps that speculated (drafted or copied)", f"{report['drafted_steps']} / {report['engine_steps']}")
    sib = report.get("siblings") or {}
    if sib.get("rows_verified_with"):
        t.add_row("siblings of x1: rounds verified with / chain lost x1 / took one",
                  f"{sib['rows_verified_with']} / {sib['chain_lost_x1']} / {sib['rows_that_took_one']}")
    look = report.get("lookup") or {}
    if look.get("rows_verified_with"):
        la = look["acceptance"]
        t.add_row("rounds verifying a block copied from the context (its τ)",
                  f"{look['rows_verified_with']} ({la['tau']:.3f})")
    run = lambda v: "off" if not v else "on" if v is True else str(v)  # noqa: E731
    t.add_row("context lookup / siblings of x1, as run",
              f"{run(look.get('effective'))} / {run(sib.get('effective'))}")
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
        label = "speedup (speculative / plain)" if "scheduler_note" not in report else \
            "speedup (scheduler's choice / plain; it drafted rarely, see below)"
        t.add_row(f"{label}{' (median of paired runs)' if runs else ''}", f"{report['speedup']:.2f}×")
        if "identical_outputs" in b:
            t.add_row("greedy outputs identical to plain", f"{b['identical_outputs']}/{report['prompts']}")
    return t
