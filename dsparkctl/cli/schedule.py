"""Scheduling commands: `calibrate`, `sweep-scheduler`, `audit`. Thin: parse, call, print."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Sequence

import typer
from rich import box
from rich.table import Table

from dsparkctl.app.audit import AuditSpec
from dsparkctl.app.sweep_scheduler import SweepSpec
from dsparkctl.cli.console import err, error_line, out, print_json, progress_bar, styled
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import JsonOpt, SeedOpt, int_list
from dsparkctl.errors import UsageError
from dsparkctl.math.policy_spec import POLICY_SPECS
from dsparkctl.tuning.sweep import DEFAULT_CONCURRENCY, DEFAULT_POLICIES

POLICY_HELP = f"Policies: {POLICY_SPECS}."


def _pct(x: float | None) -> str:
    return "—" if x is None or x != x else f"{100 * x:.2f}%"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None or x != x else format(x, fmt)


@guarded
def calibrate(
    traces: Annotated[list[Path], typer.Argument(help="Trace files from generate --trace, and/or the .pt files SGLang writes under SGLANG_DSPARK_STS_COLLECT_PATH (loaded as plain tensors, never unpickled).")],
    holdout: Annotated[float, typer.Option("--holdout", help="Fraction of requests held out for evaluation.")] = 0.2,
    bins: Annotated[int, typer.Option("--bins", help="Equal-width bins for the expected calibration error (ECE).")] = 20,
    out_path: Annotated[Path, typer.Option("--out", help="Calibration JSON to write (temperatures and metrics).")] = Path("calib.json"),
    sglang_out: Annotated[Path | None, typer.Option("--sglang-out", help="The same temperatures as SGLang reads them (default: <out>.sglang-sts.json).")] = None,
    plot_dir: Annotated[Path | None, typer.Option("--plot-dir", help="Folder for reliability plots, one PNG per position (default: <out>_reliability/).")] = None,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Calibrate the draft's confidence head on traces (Sequential Temperature Scaling, STS: one temperature per position); report held-out ECE, AUROC and Brier before and after."""
    from dsparkctl.app.calibrate import CalibrateSpec, run_calibrate, strip_diagrams

    spec = CalibrateSpec(traces=tuple(traces), holdout=holdout, bins=bins, out=out_path, sglang_out=sglang_out,
                         plot_dir=plot_dir, seed=seed)
    with progress_bar("reading traces", None, transfer=True) as update:
        result = run_calibrate(spec, log=lambda m: err.print(m, highlight=False),
                               progress=lambda done, total: update(completed=done, total=total))
    for w in result["warnings"]:
        err.print(styled(("warning:", "yellow"), f" {w}"))
    if json_out:
        print_json(strip_diagrams(result))
    else:
        out.print(calibration_table(result))


def calibration_table(result: dict[str, Any]) -> Table:
    """The human view of a calibration: per position, held-out metrics before and after STS."""
    t = Table(title=f"STS held-out survival metrics (â_k vs 'first k accepted'), "
                    f"{result['rounds']['heldout']} rounds, {result['bins']} bins; conditional metrics in --json")
    for col in ("pos", "n", "T", "fit", "ECE raw → STS", "AUROC raw → STS", "Brier raw → STS"):
        t.add_column(col, justify="right")
    for b, a, temp, f in zip(result["metrics_heldout"]["before"], result["metrics_heldout"]["after"],
                             result["temperatures"], result["fit"]):
        t.add_row(str(b["position"]), str(b["n"]), f"{temp:.3f}", f["status"], f"{_pct(b['ece'])} → {_pct(a['ece'])}",
                  f"{_num(b['auroc'])} → {_num(a['auroc'])}",
                  f"{_num(b['brier'], '.4f')} → {_num(a['brier'], '.4f')}")
    return t


@guarded
def sweep_scheduler(
    sps_table: Annotated[Path, typer.Option("--sps-table", help="Steps-per-second table from profile-sps (ours or "
                                            "the .sglang.json beside it).")],
    trace: Annotated[list[Path] | None, typer.Option("--trace", help="Trace from generate --trace (every drafted "
                                                     "token verified); repeat for several: --trace a.jsonl --trace "
                                                     "b.jsonl.")] = None,
    served: Annotated[Path | None, typer.Option("--served", help="Served acceptance (`dsparkctl served --out`) in "
                                                "place of traces: static:K policies only.")] = None,
    policies: Annotated[str | None, typer.Option("--policies", help="Comma-separated policies, e.g. "
                                                 f"static:3,dspark (default: {', '.join(DEFAULT_POLICIES)}; with "
                                                 "--served static:0..γ). " + POLICY_HELP)] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", help="Comma-separated load levels (requests decoded "
                                             "together), e.g. 1,8,64.")] = ",".join(map(str, DEFAULT_CONCURRENCY)),
    calibration: Annotated[Path | None, typer.Option("--calibration", help="Calibration from calibrate (calib.json "
                                                     "or the .sglang-sts.json beside it).")] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Request-rounds replayed per (policy, concurrency).")] = SweepSpec.rounds,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", help="Replay batches of C requests of N new tokens each, run to the end as "
        "`generate --batch-size C --max-new-tokens N` runs them (default: the steady state, C requests every step).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of throughput against per-user speed here.")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", help="Write the sweep JSON here.")] = None,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Replay recorded rounds under each verify policy and load level; report tokens per step, throughput (Θ) and per-user speed."""
    from dsparkctl.app.sweep_scheduler import run_sweep_scheduler

    spec = SweepSpec(traces=tuple(trace or ()), sps_table=sps_table, served=served,
                     policies=tuple(_policy_specs(policies)) if policies is not None else None,
                     concurrency=tuple(int_list(concurrency, "--concurrency")), calibration=calibration,
                     rounds=rounds, max_new_tokens=max_new_tokens, plot=plot, out=out_path, seed=seed)
    with progress_bar("reading traces", None, transfer=True) as update:
        result = run_sweep_scheduler(spec, log=lambda m: err.print(m, highlight=False),
                                     progress=lambda done, total: update(completed=done, total=total))
    for n in result["notes"]:
        err.print(styled(("note:", "yellow"), f" {n}"))
    if json_out:
        print_json(result)
    else:
        out.print(sweep_table(result))
        if "vllm_length_table" in result:
            out.print("vLLM num_speculative_tokens_per_batch_size (batch sizes start..end → K): "
                      + ", ".join(f"{a}..{b} → {k}" for a, b, k in result["vllm_length_table"]), highlight=False)
        for c in result.get("by_context", []):
            got = c["acceptance_prompt_tokens"]
            out.print(f"  context {c['context_len']} (acceptance of "
                      + (f"prompts of {got[0]}..{got[1] or ''} tokens" if got else "every request") + "): "
                      + ", ".join(f"{a}..{b} → {k}" for a, b, k in c["vllm_length_table"]), highlight=False)


def sweep_table(result: dict[str, Any]) -> Table:
    """The human view of a sweep: one row per (policy, concurrency) cell."""
    src = result.get("acceptance_source", {})
    what = (f"rounds from served acceptance ({src.get('engine')} {src.get('from')}, {src.get('drafts')} drafted steps)"
            if src.get("kind") == "served" else "recorded rounds")
    t = Table(title=f"Scheduler sweep: {result['pooled_rounds']} {what}, γ={result['block_size']}, "
                    f"{result['rounds_per_cell']} request-rounds per cell (τ includes the bonus token)")
    rows = [(r["policy"], str(r["concurrency"]), f"{r['tokens_per_step']:.3f}", f"{r['mean_verify']:.2f}",
             f"{r['mean_batch_tokens']:.1f}", f"{100 * r['drafted_share']:.0f}%", f"{r['throughput_tok_s']:.1f}",
             f"{r['per_user_tok_s']:.2f}") for r in result["rows"]]
    for i, col in enumerate(("policy", "C", "τ tok/step", "mean ℓ", "mean B", "drafted", "Θ tok/s", "user tok/s")):
        width = max([len(row[i]) for row in rows], default=0)  # a narrow console wraps headers, never a value
        t.add_column(col, justify="left" if i == 0 else "right", no_wrap=True, min_width=width)
    for row in rows:
        t.add_row(*row)
    return t


@guarded
def audit(
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated policies, e.g. static:3,dspark "
                                          f"(default: {', '.join(AuditSpec.policies)}). " + POLICY_HELP,
                                          show_default=False)] = ",".join(AuditSpec.policies),
    rounds: Annotated[int, typer.Option("--rounds", help="Request-rounds simulated per policy and setting.")] = AuditSpec.rounds,
    plain_rounds: Annotated[int, typer.Option("--plain-rounds", help="Request-rounds per policy on the settings "
                                              "where dspark may skip the draft (simulated one step at a time, so "
                                              "fewer).")] = AuditSpec.plain_rounds,
    random_settings: Annotated[int, typer.Option("--random-settings", help="Random settings to audit besides the "
                                                 "fixed ones.")] = AuditSpec.random_settings,
    alpha: Annotated[float, typer.Option("--alpha", help="Chi-square significance level.")] = AuditSpec.alpha,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Check that each policy is lossless: chi-square tests that the first (and first two) output tokens follow the target's distribution."""
    from dsparkctl.app.audit import run_audit

    spec = AuditSpec(policies=tuple(_policy_specs(policies)), rounds=rounds, plain_rounds=plain_rounds,
                     random_settings=random_settings, alpha=alpha, seed=seed)
    with progress_bar("audit", None, unit="runs") as update:
        report = run_audit(spec, progress=lambda done, total: update(completed=done, total=total))
    if json_out:
        print_json(report)
    else:
        out.print(audit_table(report))
    if report["unexpected_failures"]:
        err.print(error_line("error:", f"{report['unexpected_failures']} policy run(s) claimed lossless failed the audit"))
        raise typer.Exit(1)


def audit_table(report: dict[str, Any]) -> Table:
    """The human view of an audit: one row per (setting, policy) run. On a narrow console (80
    columns) the text columns wrap; a number is never wrapped or cut (`number_columns`)."""
    t = Table(title=f"Losslessness audit (chi-square vs target, α={report['alpha']:g}); "
                    "P(tok0) = P(first token = A) in Appendix A", box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    rows = []
    for r in report["results"]:
        verdict = r["verdict"] if r["verdict"] == "pass" or r["claimed_lossless"] else "FAIL*"
        rows.append((f"{r['setting']}\n{r['policy']}", str(r["rounds"]),
                     f"{r['p_token0']:.4f}\n[{r['p_token0_ci'][0]:.4f}, {r['p_token0_ci'][1]:.4f}]",
                     f"{r['target_token0']:.3f}", f"{_stat(r['first_stat'])}\n({r['first_p']:.3g})",
                     f"{_stat(r['pair_stat'])}\n({r['pair_p']:.3g})", f"{r['mean_verify']:.2f}",
                     f"{100 * r['drafted_share']:.0f}%", verdict))
    if any(row[-1] == "FAIL*" for row in rows):
        t.caption = "FAIL*: biased, as expected of a policy not claimed lossless"
    number_columns(t, ("setting\npolicy", "rounds", "P(tok0)\n[95% CI]", "target", "χ² 1st\n(p)", "χ² 1st+2nd\n(p)",
                       "mean ℓ", "drafted", "verdict"), rows, text=(0, 8))
    return t


def number_columns(t: Table, names: Sequence[str], rows: Sequence[Sequence[str]], text: Sequence[int] = (0,)) -> None:
    """Add columns `names` and `rows` to `t`: a column of numbers is as wide as its widest line and
    never wraps; the `text` columns (names, verdicts) wrap instead when the console is narrow."""
    for i, col in enumerate(names):
        if i in text:
            t.add_column(col, justify="left", overflow="fold", min_width=4)
        else:
            width = max([len(line) for row in [*rows, names] for line in row[i].split("\n")], default=0)
            t.add_column(col, justify="right", no_wrap=True, min_width=width)
    for row in rows:
        t.add_row(*row)


def _stat(x: float | None) -> str:
    return f"{float('inf') if x is None else x:.1f}"  # to_json writes an infinite statistic as null


def _policy_specs(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise UsageError(f"--policies {text!r} names no policy", POLICY_HELP)
    return specs


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
    app.command("sweep-scheduler")(sweep_scheduler)
    app.command("audit")(audit)
