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

Measure = choices("Measure", MEASURES)


def register(app: typer.Typer) -> None:
    app.command("profile-sps", help="Time the engine's whole speculative step (or the target's forward alone) "
                "over a grid of batch tokens (requests × tokens per request) and write an SPS table (ours + "
                "SGLang's) and a PNG.")(profile_sps_cmd)


@guarded
def profile_sps_cmd(
    out_path: Annotated[Path, typer.Option("--out", help="Our SPS table JSON (also written: <out>.sglang.json and <out>.png).")] = Path("sps.json"),
    target: TargetOpt = None,
    draft: DraftOpt = None,
    revision: RevisionOpt = None,
    measure: Annotated[Measure, typer.Option("--measure", help="whole-step: draft + schedule + verify + context "
                                             "update of our engine, what SGLang's table holds (default); "
                                             "target-forward: the target's verify forward alone.")] = None,
    requests: Annotated[str, typer.Option("--requests", help="Comma-separated request counts.")] = "1,2,4,8",
    tokens: Annotated[Optional[str], typer.Option("--tokens-per-request", help="Comma-separated verify tokens per "
                                                  "request (1 + drafts); default 1..γ+1 (whole-step) or "
                                                  "1,2,3,4,6,8 (target-forward).")] = None,
    context_len: Annotated[int, typer.Option("--context-len", help="Cached context tokens per request.")] = 256,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats per point (the fit reads their "
                                                                     "lower quartile).")] = 12,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps per point.")] = 2,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    cpu_kernels: CpuKernelsOpt = CpuKernels.auto,
    draft_weights: DraftWeightsOpt = DraftWeights.auto,
    seed: SeedOpt = 0,
    sglang_out: Annotated[Optional[Path], typer.Option("--sglang-out", help="SGLang table path (default <out stem>.sglang.json).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG path (default <out stem>.png).")] = None,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.app.profile_sps import ProfileSpec, run_profile_sps

    spec = ProfileSpec(out=out_path, sglang_out=sglang_out, plot=plot, measure=(measure or Measure.whole_step).value,
                       requests=tuple(int_list(requests, "--requests")),
                       tokens_per_request=tuple(int_list(tokens, "--tokens-per-request")) if tokens is not None else None,
                       context_len=context_len, repeats=repeats, warmup=warmup, target=target, draft=draft,
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

