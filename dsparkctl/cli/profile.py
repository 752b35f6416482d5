"""`dsparkctl profile-sps`: the engine's steps-per-second table, for the schedulers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from dsparkctl.cli.checks import Output, check_outputs, check_seed
from dsparkctl.cli.common import DeviceOpt, DType, DTypeOpt, Device, JsonOpt, SeedOpt, err, guarded, out, print_json, show_progress, styled
from dsparkctl.errors import UsageError
from dsparkctl.strict_json import finite


def register(app: typer.Typer) -> None:
    app.command("profile-sps", help="Time the target's forward over a grid of batch tokens "
                "(requests × tokens per request) and write an SPS table (ours + SGLang's) and a PNG.")(profile_sps_cmd)


def _int_list(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated integers, got {text!r}", f"e.g. {name} 1,2,4") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{name} must be positive integers, got {text!r}", f"e.g. {name} 1,2,4")
    return vals


def plot_sps(bt: list[int], sps: list[float], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsparkctl.fsutil import save_figure

    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(bt, sps, "o-", color="tab:blue", label="steps/s")
    ax1.set_xlabel("batch tokens B (requests × tokens per request)")
    ax1.set_ylabel("steps per second", color="tab:blue")
    ax1.set_xscale("log", base=2)
    ax2 = ax1.twinx()
    ax2.plot(bt, [1000.0 / s for s in sps], "s--", color="tab:red", label="ms/step")
    ax2.set_ylabel("ms per step", color="tab:red")
    ax1.set_title(title)
    ax1.grid(True, alpha=0.3)
    save_figure(fig, path)
    plt.close(fig)


@guarded
def profile_sps_cmd(
    out_path: Annotated[Path, typer.Option("--out", help="Our SPS table JSON (also written: <out>.sglang.json and <out>.png).")] = Path("sps.json"),
    target: Annotated[Optional[str], typer.Option("--target", help="Target model folder or hub id (default: embedded SmolLM2).")] = None,
    revision: Annotated[Optional[str], typer.Option("--revision")] = None,
    requests: Annotated[str, typer.Option("--requests", help="Comma-separated request counts.")] = "1,2,4,8",
    tokens: Annotated[str, typer.Option("--tokens-per-request", help="Comma-separated verify tokens per request (1 + drafts).")] = "1,2,3,4,6,8",
    context_len: Annotated[int, typer.Option("--context-len", help="Cached context tokens per request.")] = 256,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats per point (median).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps per point.")] = 2,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    seed: SeedOpt = 0,
    sglang_out: Annotated[Optional[Path], typer.Option("--sglang-out", help="SGLang table path (default <out stem>.sglang.json).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG path (default <out stem>.png).")] = None,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.engine.profile import profile_sps, table_from_points
    from dsparkctl.math.sps import SPSTable
    from dsparkctl.models.loading import load_target, resolve_device, resolve_dtype
    from dsparkctl.models.target import TargetAdapter
    from dsparkctl.provenance import provenance

    reqs, toks = _int_list(requests, "--requests"), _int_list(tokens, "--tokens-per-request")
    if context_len < 1 or repeats < 1 or warmup < 0:
        raise UsageError("--context-len and --repeats must be >= 1, --warmup >= 0",
                         "e.g. --context-len 256 --repeats 5 --warmup 2")
    check_seed(seed)
    check_outputs([Output(out_path, "--out")])  # first: the other names derive from it
    sg = sglang_out or out_path.with_name(out_path.stem + ".sglang.json")
    png = plot or out_path.with_suffix(".png")
    check_outputs([Output(out_path, "--out"), Output(sg, "--sglang-out"), Output(png, "--plot", "figure")])
    dev = resolve_device(device.value)
    dt = resolve_dtype(dtype.value, dev)
    tgt = load_target(target, dev, dt, revision=revision, log=lambda m: err.print(styled((m, "dim"))))
    adapter = TargetAdapter(tgt.model, ())
    total = len(set(reqs)) * len(set(toks))
    progress = None
    if show_progress():
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        progress = Progress(TextColumn("profile-sps"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeRemainingColumn(), console=err, transient=True)
        progress.start()
        task = progress.add_task("p", total=total)
    try:
        points = profile_sps(adapter, reqs, toks, context_len, repeats, warmup, seed,
                             on_point=(lambda p: progress.advance(task)) if progress else None)
    finally:
        if progress:
            progress.stop()
    bt, sps = table_from_points(points)
    meta = provenance(target=tgt.name, device=str(dev), dtype=str(dt).replace("torch.", ""),
                      context_len=context_len, repeats=repeats, warmup=warmup,
                      grid={"requests": sorted(set(reqs)), "tokens_per_request": sorted(set(toks))},
                      points=[{"requests": p.requests, "tokens_per_request": p.tokens_per_request,
                               "batch_tokens": p.batch_tokens, "median_ms": round(p.median_ms, 4),
                               "ms": [round(x, 4) for x in p.ms]} for p in points])
    table = SPSTable(bt, sps, meta=meta)
    plot_sps(bt, sps, png, f"{tgt.name} on {dev} ({str(dt).replace('torch.', '')}), context {context_len}")
    table.save(sg, fmt="sglang")
    table.save(out_path, fmt="dsparkctl")  # ours last: its presence means all three were written
    result = {"table": str(out_path), "sglang_table": str(sg), "plot": str(png),
              "batch_tokens": bt, "steps_per_sec": [round(s, 3) for s in sps],
              "ms_per_step": [round(1000 / s, 3) for s in sps]}
    if json_out:
        print_json(finite(result))
        return
    t = Table(title=f"SPS of {tgt.name} ({dev}, context {context_len}, median of {repeats})", title_justify="left")
    for c in ("batch tokens", "steps/s", "ms/step"):
        t.add_column(c, justify="right")
    for b, s in zip(bt, sps):
        t.add_row(str(b), f"{s:.2f}", f"{1000 / s:.2f}")
    out.print(t)
    out.print(f"wrote {out_path}, {sg}, {png}", highlight=False)
