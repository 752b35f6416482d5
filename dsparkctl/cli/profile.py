"""`dsparkctl profile-sps`: the engine's steps-per-second table, for the schedulers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from dsparkctl.cli.console import err, out, print_json, progress_bar, styled
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import (CpuKernels, CpuKernelsOpt, DraftWeights, DraftWeightsOpt, Device, DeviceOpt, DraftOpt, DType, DTypeOpt, JsonOpt,
                                   RevisionOpt, SeedOpt, TargetOpt, choices, int_list)
from dsparkctl.engine.profile import MEASURES
from dsparkctl.errors import UsageError

Measure = choices("Measure", MEASURES)


# With --server (the served engine's step instead of ours)
ServerOpt = Annotated[Optional[list[str]], typer.Option(
    "--server", help="Profile this running OpenAI-compatible vLLM or SGLang server "
    "(http://HOST:PORT) instead of our engine; repeat to pool a plain and a speculative server into one table.")]
ServedModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help="With --server: the served model name (default: the one the server lists).")]
OutputTokensOpt = Annotated[int, typer.Option(
    "--output-tokens", help="With --server: tokens each request generates (ignore_eos).")]
TimeLimitOpt = Annotated[float, typer.Option(
    "--time-limit", help="With --server: seconds the whole grid may take; stopped with nothing written once it "
    "cannot fit.")]


def register(app: typer.Typer) -> None:
    app.command("profile-sps", help="Time the engine's whole speculative step (or the target's forward alone) "
                "over a grid of batch tokens (requests × tokens per request) and write an SPS table (ours + "
                "SGLang's) and a PNG. With --server: time the step of a running vLLM or SGLang server instead, "
                "from streamed requests at each concurrency.")(profile_sps_cmd)


@guarded
def profile_sps_cmd(
    out_path: Annotated[Path, typer.Option("--out", help="Our SPS table JSON (also written: <out>.sglang.json and <out>.png).")] = Path("sps.json"),
    target: TargetOpt = None,
    draft: DraftOpt = None,
    revision: RevisionOpt = None,
    measure: Annotated[Measure, typer.Option("--measure", help="whole-step (default): our engine's whole speculative "
                                             "step (draft, schedule, verify, cache update), what SGLang's table "
                                             "holds; target-forward: the target's verify forward alone.")] = None,
    requests: Annotated[str, typer.Option("--requests", help="Comma-separated request counts.")] = "1,2,4,8",
    tokens: Annotated[Optional[str], typer.Option("--tokens-per-request", help="Comma-separated verify tokens per "
                                                  "request (1 + drafts); default 1..γ+1 (whole-step) or "
                                                  "1,2,3,4,6,8 (target-forward).")] = None,
    context_len: Annotated[str, typer.Option("--context-len", help="Cached context tokens per request (with "
                                             "--server: comma-separated prompt lengths, e.g. 256,2048; the first "
                                             "makes the table, each gets its own in by_context).")] = "256",
    repeats: Annotated[Optional[int], typer.Option("--repeats", help="Timed repeats per point (the fit reads their "
                                                   "lower quartile; default: 12; with --server: rounds, their median; "
                                                   "default: 5).", show_default=False)] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", help="Untimed warm-up steps per point (default: 2; "
                                                  "with --server: rounds, default: 1).", show_default=False)] = None,
    server: ServerOpt = None,
    model: ServedModelOpt = None,
    output_tokens: OutputTokensOpt = 64,
    time_limit: TimeLimitOpt = 600.0,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    cpu_kernels: CpuKernelsOpt = CpuKernels.auto,
    draft_weights: DraftWeightsOpt = DraftWeights.auto,
    seed: SeedOpt = 0,
    sglang_out: Annotated[Optional[Path], typer.Option("--sglang-out", help="SGLang table path (default: <out stem>.sglang.json).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG path (default: <out stem>.png).")] = None,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.app.profile_sps import ProfileSpec, run_profile_sps

    if server:
        return _profile_server(server, model, out_path, sglang_out, plot, requests, context_len, output_tokens,
                               repeats, warmup, time_limit, seed, json_out, given=_model_options_given(
                                   target, draft, revision, measure, tokens, device, dtype, cpu_kernels, draft_weights))
    context = _engine_context(context_len, model, output_tokens, time_limit)
    spec = ProfileSpec(out=out_path, sglang_out=sglang_out, plot=plot, measure=(measure or Measure.whole_step).value,
                       requests=tuple(int_list(requests, "--requests")),
                       tokens_per_request=tuple(int_list(tokens, "--tokens-per-request")) if tokens is not None else None,
                       context_len=context, repeats=12 if repeats is None else repeats,
                       warmup=2 if warmup is None else warmup, target=target, draft=draft,
                       revision=revision, device=device.value, dtype=dtype.value, cpu_kernels=cpu_kernels.value, draft_weights=draft_weights.value,
                       seed=seed)
    with progress_bar("profile-sps", None) as update:
        result, table = run_profile_sps(spec, log=lambda m: err.print(styled((m, "dim"))),
                                    on_progress=lambda done, total: update(completed=done, total=total))
    for w in result["warnings"]:
        err.print(styled(("warning:", "yellow"), f" {w}"))
    if json_out:
        print_json(result)
    else:
        print_tables(result, table, spec)


def print_tables(result: dict, table: Any, spec: Any) -> None:
    """The human view: steps/s by batch tokens, the fitted grid, and the files written."""
    meta = table.meta
    t = Table(title=f"SPS of {meta['target']}, {spec.measure} ({meta['device']}, context {spec.context_len}, "
              f"lower quartile of {spec.repeats})", title_justify="left")
    for c in ("batch tokens", "steps/s", "ms/step"):
        t.add_column(c, justify="right")
    for b, s in zip(table.batch_tokens, table.steps_per_sec):
        t.add_row(str(b), f"{s:.2f}", f"{1000 / s:.2f}")
    out.print(t)
    g = table.grid
    gt = Table(title="fitted step time, ms (requests × tokens per request; plain = no draft)", title_justify="left")
    for c in ("requests", *map(str, g.tokens), *(("plain",) if g.plain_ms else ())):
        gt.add_column(c, justify="right")
    for i, r in enumerate(g.requests):
        gt.add_row(str(r), *(f"{v:.2f}" for v in g.step_ms[i]), *((f"{g.plain_ms[i]:.2f}",) if g.plain_ms else ()))
    out.print(gt)
    out.print(f"wrote {result['table']}, {result['sglang_table']}, {result['plot']}", highlight=False)



def _engine_context(context_len: str, model, output_tokens: int, time_limit: float) -> int:
    """Our engine's one context length, the server-only options refused."""
    for name, given in (("--model", model), ("--output-tokens", output_tokens != 64), ("--time-limit", time_limit != 600.0)):
        if given:
            raise UsageError(f"{name} is for --server", f"drop {name}, or add --server URL")
    contexts = int_list(context_len, "--context-len", maximum=2 ** 31 - 1)  # the model bounds it, once loaded
    if len(contexts) != 1:
        raise UsageError("--context-len takes one length when profiling our engine", "e.g. --context-len 256 "
                         "(several lengths are for --server)")
    return contexts[0]


def _model_options_given(target, draft, revision, measure, tokens, device, dtype, cpu_kernels, draft_weights) -> list[str]:
    """The options that choose or run our engine, where given: they mean nothing with --server."""
    given = {"--target": target is not None, "--draft": draft is not None, "--revision": revision is not None,
             "--measure": measure is not None, "--tokens-per-request": tokens is not None,
             "--device": device != Device.auto, "--dtype": dtype != DType.auto,
             "--cpu-kernels": cpu_kernels != CpuKernels.auto, "--draft-weights": draft_weights != DraftWeights.auto}
    return [k for k, v in given.items() if v]


def _profile_server(servers, model, out_path, sglang_out, plot, requests, context_len, output_tokens, repeats,
                    warmup, time_limit, seed, json_out, given) -> None:
    from dsparkctl.app.profile_server import ServerProfileSpec, run_profile_server

    if given:
        raise UsageError(f"{given[0]} chooses how our engine runs; --server times the server's own engine",
                         f"drop {given[0]} (the server's command line decides its model and speculation)")
    spec = ServerProfileSpec(servers=tuple(servers), model=model, out=out_path, sglang_out=sglang_out, plot=plot,
                             requests=tuple(int_list(requests, "--requests")),
                             context_lens=tuple(int_list(context_len, "--context-len")), output_tokens=output_tokens,
                             repeats=5 if repeats is None else repeats, warmup=1 if warmup is None else warmup,
                             time_limit=time_limit, seed=seed)
    with progress_bar("profile-sps --server", None) as update:
        doc, _ = run_profile_server(spec, log=lambda m: err.print(styled((m, "dim"))),
                                    on_progress=lambda done, total: update(completed=done, total=total))
    if json_out:
        print_json(doc)
        return
    for srv in doc["servers"]:
        spec = srv["speculative"]
        out.print(f"{srv['server']}: {srv['engine'] or 'unknown engine'} {srv['version'] or ''}, model {srv['model']}, "
                  + (f"{spec['positions']} drafts per step" if spec else "no speculation"), highlight=False)
    several = len(doc["servers"]) > 1
    t = Table(title="served step (median of rounds; B = tokens verified per step, from the server's counters)",
              title_justify="left")
    for c in (*(("server",) if several else ()), "context", "R", "kind", "B", "ms/step", "quartiles", "tok/step",
              "drafted"):
        t.add_column(c, justify="right")
    for p in doc["points"]:
        share = "—" if p["drafted_share"] is None else f"{p['drafted_share']:.2f}"
        t.add_row(*((p["server"],) if several else ()), str(p["context_len"]), str(p["requests"]), p["kind"],
                  f"{p['batch_tokens']:.1f}", f"{p['step_ms']:.1f}",
                  f"{p['step_ms_quartiles'][0]:.1f}–{p['step_ms_quartiles'][1]:.1f}", f"{p['tokens_per_step']:.2f}", share)
    out.print(t)
    out.print(f"wrote {doc['table']}, {doc['sglang_table']}, {doc['plot']}", highlight=False)
