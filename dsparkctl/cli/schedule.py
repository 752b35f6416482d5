"""Scheduling commands: `calibrate`, `sweep-scheduler`, `audit`. Thin: parse, call, print."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from dsparkctl.checks import Output, check_outputs
from dsparkctl.cli.common import JsonOpt, SeedOpt, err, error_line, guarded, int_list, out, print_json, styled
from dsparkctl.errors import UsageError
from dsparkctl.fsutil import staged, write_json
from dsparkctl.math.policies import POLICY_SPECS

POLICY_HELP = f"Policies: {POLICY_SPECS}."


def _pct(x: float | None) -> str:
    return "—" if x is None or x != x else f"{100 * x:.2f}%"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None or x != x else format(x, fmt)


@guarded
def calibrate(
    traces: Annotated[list[Path], typer.Argument(help="Trace files (JSON lines with confidence logits) and/or SGLang STS shards (.pt under SGLANG_DSPARK_STS_COLLECT_PATH; read with weights_only, never unpickled).")],
    holdout: Annotated[float, typer.Option("--holdout", help="Fraction of requests held out for evaluation.")] = 0.2,
    bins: Annotated[int, typer.Option("--bins", help="Equal-width ECE bins.")] = 20,
    out_path: Annotated[Path, typer.Option("--out", help="Our calibration JSON (temperatures + metrics).")] = Path("calib.json"),
    sglang_out: Annotated[Path | None, typer.Option("--sglang-out", help="SGLang STS file (default: <out>.sglang-sts.json).")] = None,
    plot_dir: Annotated[Path | None, typer.Option("--plot-dir", help="Reliability PNGs (default: <out>_reliability/).")] = None,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Fit STS temperatures on traces; report held-out ECE/AUROC/Brier per position before and after."""
    from dsparkctl.calibrate import run_calibration, sglang_sts, strip_diagrams
    from dsparkctl.plots import reliability_diagrams

    check_outputs([Output(out_path, "--out")])  # first: the other names derive from it
    sglang_out = sglang_out or out_path.with_name(out_path.stem + ".sglang-sts.json")
    plot_dir = plot_dir or out_path.with_name(out_path.stem + "_reliability")
    check_outputs([Output(out_path, "--out"), Output(sglang_out, "--sglang-out"),
                   Output(plot_dir, "--plot-dir", "folder")], inputs=traces)
    result = run_calibration(traces, holdout=holdout, bins=bins, seed=seed,
                             names={"holdout": "--holdout", "bins": "--bins"})
    with staged() as stage:  # all six outputs appear together, or none (a full disk leaves nothing)
        pngs = reliability_diagrams(result, plot_dir, stage)
        result["outputs"] = {"sglang_sts": str(sglang_out), "reliability_pngs": pngs}
        write_json(stage(sglang_out), sglang_sts(result))
        write_json(stage(out_path), result)
    err.print(f"wrote {out_path}, {sglang_out}, {len(pngs)} reliability PNGs in {plot_dir}", highlight=False)
    for w in result["warnings"]:
        err.print(styled(("warning:", "yellow"), f" {w}"))
    if json_out:
        print_json(strip_diagrams(result))
        return
    t = Table(title=f"STS held-out survival metrics (â_k vs 'first k accepted'), "
                    f"{result['rounds']['heldout']} rounds, {bins} bins; conditional metrics in --json")
    for col in ("pos", "n", "T", "fit", "ECE raw → STS", "AUROC raw → STS", "Brier raw → STS"):
        t.add_column(col, justify="right")
    for b, a, temp, f in zip(result["metrics_heldout"]["before"], result["metrics_heldout"]["after"],
                             result["temperatures"], result["fit"]):
        t.add_row(str(b["position"]), str(b["n"]), f"{temp:.3f}", f["status"], f"{_pct(b['ece'])} → {_pct(a['ece'])}",
                  f"{_num(b['auroc'])} → {_num(a['auroc'])}",
                  f"{_num(b['brier'], '.4f')} → {_num(a['brier'], '.4f')}")
    out.print(t)


@guarded
def sweep_scheduler(
    trace: Annotated[list[Path], typer.Option("--trace", help="Full-verification trace(s); repeat the option.")],
    sps_table: Annotated[Path, typer.Option("--sps-table", help="SPS table (ours or SGLang's).")],
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated. " + POLICY_HELP)] =
        "static:0,static:1,static:3,threshold:0.5,survival:0.4,budget:256,dspark,dspark-async",
    concurrency: Annotated[str, typer.Option("--concurrency", help="Comma-separated load levels.")] =
        "1,2,4,8,16,32,64,128,256,512,1024",
    calibration: Annotated[Path | None, typer.Option("--calibration", help="calib.json or SGLang STS file.")] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Request-rounds replayed per (policy, concurrency).")] = 20_000,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", help="Replay batches of C requests of N new tokens each, run to the end as "
        "`generate --batch-size C --max-new-tokens N` runs them (default: the steady state, C requests every step).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the frontier PNG here.")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", help="Write the sweep JSON here.")] = None,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Replay recorded rounds under each policy and concurrency; report tokens/step, Θ and per-user speed."""
    from dsparkctl.sweep import run_sweep

    if max_new_tokens is not None and not 2 <= max_new_tokens <= rounds + 1:
        raise UsageError(f"--max-new-tokens must be in [2, --rounds + 1 = {rounds + 1}] (a request's first token comes from "
                         f"the prefill; a batch replays at least N / (γ + 1) steps), got {max_new_tokens}",
                         "give the new tokens per request of the batches to replay; raise --rounds for longer ones")
    specs = _policy_specs(policies)
    levels = int_list(concurrency, "--concurrency")
    inputs = [*trace, sps_table] + ([calibration] if calibration else [])
    check_outputs([Output(p, opt, kind) for p, opt, kind in ((plot, "--plot", "figure"), (out_path, "--out", "file"))
                   if p is not None], inputs=inputs)
    result = run_sweep(trace, sps_table, specs, levels, calibration, rounds, seed,
                       names={"rounds": "--rounds", "concurrency": "--concurrency"}, max_new_tokens=max_new_tokens)
    if plot:
        from dsparkctl.plots import frontier_plot

        frontier_plot(result["rows"], plot)
        err.print(f"wrote {plot}", highlight=False)
    if out_path:
        write_json(out_path, result)
        err.print(f"wrote {out_path}", highlight=False)
    if json_out:
        print_json(result)
        return
    t = Table(title=f"Scheduler sweep: {result['pooled_rounds']} recorded rounds, γ={result['block_size']}, "
                    f"{rounds} request-rounds per cell (τ includes the bonus token)")
    t.add_column("policy", no_wrap=True)
    for col in ("C", "τ tok/step", "mean ℓ", "mean B", "drafted", "Θ tok/s", "user tok/s"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in result["rows"]:
        t.add_row(r["policy"], str(r["concurrency"]), f"{r['tokens_per_step']:.3f}", f"{r['mean_verify']:.2f}",
                  f"{r['mean_batch_tokens']:.1f}", f"{100 * r['drafted_share']:.0f}%", f"{r['throughput_tok_s']:.1f}",
                  f"{r['per_user_tok_s']:.2f}")
    out.print(t)


@guarded
def audit(
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated. " + POLICY_HELP)] =
        "retrospective,dspark,dspark-async,static:1,static:2,threshold:0.6,survival:0.3,budget:2",
    rounds: Annotated[int, typer.Option("--rounds", help="Request-rounds simulated per policy and setting.")] = 200_000,
    plain_rounds: Annotated[int, typer.Option("--plain-rounds", help="Request-rounds per policy on the settings "
                                              "whose SPS table prices a plain step (+plain: dspark and dspark-async "
                                              "skip the draft there, simulated one step at a time).")] = 40_000,
    random_settings: Annotated[int, typer.Option("--random-settings", help="Randomised settings besides Appendix A.")] = 3,
    alpha: Annotated[float, typer.Option("--alpha", help="Chi-square significance level.")] = 1e-3,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    """Losslessness audit: chi-square of the first (and first two) output tokens against the target."""
    from dsparkctl.math.audit import audit_policies, check_alpha

    specs = _policy_specs(policies)
    check_alpha(alpha, "--alpha")
    for flag, n in (("--rounds", rounds), ("--plain-rounds", plain_rounds)):
        if n < 1000:
            raise UsageError(f"{flag} {n} is too few for a chi-square test", "use at least 1000")
    if random_settings < 0:
        raise UsageError(f"--random-settings {random_settings} is negative", "use 0 for Appendix A only, e.g. 3")
    results = audit_policies(specs, rounds, random_settings, alpha, seed, plain_rounds=plain_rounds)
    unexpected = [r for r in results if r.claimed_lossless and not r.passed]
    if json_out:
        print_json({"alpha": alpha, "results": [r.to_json() for r in results],
                    "unexpected_failures": len(unexpected)})
    else:
        t = Table(title=f"Losslessness audit (chi-square vs target, α={alpha:g}); "
                        "P(tok0) = P(first token = A) in Appendix A")
        for col in ("setting", "policy", "rounds", "P(tok0) [95% CI]", "target", "χ² 1st (p)", "χ² 1st+2nd (p)",
                    "mean ℓ", "drafted", "verdict"):
            t.add_column(col, justify="right", no_wrap=col not in ("χ² 1st (p)", "χ² 1st+2nd (p)"))
        for r in results:
            verdict = "pass" if r.passed else ("FAIL (biased, expected)" if not r.claimed_lossless else "FAIL")
            t.add_row(r.setting, r.policy, str(r.rounds),
                      f"{r.p_token0:.4f} [{r.p_token0_ci[0]:.4f}, {r.p_token0_ci[1]:.4f}]", f"{r.target_token0:.3f}",
                      f"{r.first_stat:.1f} ({r.first_p:.3g})", f"{r.pair_stat:.1f} ({r.pair_p:.3g})",
                      f"{r.mean_verify:.2f}", f"{100 * r.drafted_share:.0f}%", verdict)
        out.print(t)
    if unexpected:
        err.print(error_line("error:", f"{len(unexpected)} policy run(s) claimed lossless failed the audit"))
        raise typer.Exit(1)


def _policy_specs(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise UsageError(f"--policies {text!r} names no policy", POLICY_HELP)
    return specs


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
    app.command("sweep-scheduler")(sweep_scheduler)
    app.command("audit")(audit)
