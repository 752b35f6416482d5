"""`dsparkctl profile-sps`: the engine's steps-per-second table, for the schedulers."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from dsparkctl.cli.checks import Output, check_outputs, local_inputs
from dsparkctl.cli.common import (check_batch_tokens, CpuKernels, CpuKernelsOpt, DeviceOpt, DraftOpt, DType, DTypeOpt, Device, JsonOpt, RevisionOpt, SeedOpt,
                                  TargetOpt, err, guarded, int_list, out, print_json, progress_bar, styled)
from dsparkctl.cli.common import choices
from dsparkctl.engine.profile import MEASURES
from dsparkctl.errors import UsageError
from dsparkctl.provenance import provenance


Measure = choices("Measure", MEASURES)


def register(app: typer.Typer) -> None:
    app.command("profile-sps", help="Time the engine's whole speculative step (or the target's forward alone) "
                "over a grid of batch tokens (requests × tokens per request) and write an SPS table (ours + "
                "SGLang's) and a PNG.")(profile_sps_cmd)


def check_grid(requests: list[int], tokens: list[int]) -> None:
    """Refuse a grid with one batch-token count: SGLang reads a one-probe table as uninitialised."""
    if len({r * t for r in requests for t in tokens}) < 2:
        raise UsageError(f"the grid --requests {','.join(map(str, requests))} × --tokens-per-request "
                         f"{','.join(map(str, tokens))} gives one batch-token count; SGLang treats a one-probe "
                         "table as uninitialised (it verifies every draft)",
                         "profile at least two batch-token counts, e.g. --tokens-per-request 1,2,4,6")


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
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats per point (median).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps per point.")] = 2,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    cpu_kernels: CpuKernelsOpt = CpuKernels.auto,
    seed: SeedOpt = 0,
    sglang_out: Annotated[Optional[Path], typer.Option("--sglang-out", help="SGLang table path (default <out stem>.sglang.json).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG path (default <out stem>.png).")] = None,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.engine.profile import fit_table, profile_sps, profile_whole_step
    from dsparkctl.engine.session import open_session, open_target
    from dsparkctl.engine.speculative import SpeculativeEngine
    from dsparkctl.math.policies import parse_policy
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.sps_io import save_sps_table

    measure = measure or Measure.whole_step
    reqs = int_list(requests, "--requests")
    toks = int_list(tokens, "--tokens-per-request") if tokens is not None else None
    if context_len < 1 or repeats < 1 or warmup < 0:
        raise UsageError("--context-len and --repeats must be >= 1, --warmup >= 0",
                         "e.g. --context-len 256 --repeats 5 --warmup 2")
    inputs = local_inputs(target=target, drafts=[draft])
    check_outputs([Output(out_path, "--out")], inputs)  # first: the other names derive from it
    sg = sglang_out or out_path.with_name(out_path.stem + ".sglang.json")
    png = plot or out_path.with_suffix(".png")
    check_outputs([Output(out_path, "--out"), Output(sg, "--sglang-out"), Output(png, "--plot", "figure")], inputs)
    if toks is None and measure == Measure.target_forward:
        toks = [1, 2, 3, 4, 6, 8]
    if toks is not None:
        check_grid(reqs, toks)  # before any model loads
    check_batch_tokens(reqs, toks or [8], context_len)
    log = lambda m: err.print(styled((m, "dim")))  # noqa: E731
    if measure == Measure.whole_step:
        sess = open_session(target, draft, device.value, dtype.value, revision, seed=seed, log=log,
                            cpu_kernels=cpu_kernels.value)
        engine = SpeculativeEngine(sess.adapter, sess.draft, parse_policy(f"static:{sess.draft.block_size}"),
                                   SamplingParams(0.0), stop_token_ids=sess.stop_ids)
        if toks is None:
            toks = list(range(1, sess.draft.block_size + 2))
            check_grid(reqs, toks)
        run = functools.partial(profile_whole_step, engine)
    else:
        sess = open_target(target, device.value, dtype.value, revision, log=log, cpu_kernels=cpu_kernels.value)
        run = functools.partial(profile_sps, sess.plain_adapter())
    done = itertools.count(1)
    n_points = len(set(reqs)) * (len(set(toks)) + (measure == Measure.whole_step))
    with progress_bar("profile-sps", n_points) as update:
        points = run(reqs, toks, context_len, repeats, warmup, seed, on_point=lambda p: update(next(done)))
    tgt, dev, dt = sess.target, sess.device, str(sess.dtype).replace("torch.", "")
    drafted = ((str(Path(draft).resolve()) if draft and Path(draft).exists() else sess.draft_name)
               if measure == Measure.whole_step else None)
    meta = provenance(target=tgt.name, measures=measure.value, draft=drafted, device=str(dev), dtype=dt,
                      cpu_kernels=sess.cpu_kernels, context_len=context_len, repeats=repeats, warmup=warmup,
                      block_size=sess.draft.block_size if measure == Measure.whole_step else None,
                      conditions=sess.conditions(),
                      points=[{"requests": p.requests, "tokens_per_request": p.tokens_per_request, "plain": p.plain,
                               "batch_tokens": p.batch_tokens, "median_ms": round(p.median_ms, 4),
                               "ms": [round(x, 4) for x in p.ms]} for p in points])
    table, warnings = fit_table(points, meta)
    for w in warnings:
        err.print(styled(("warning:", "yellow"), f" {w}"))
    bt, sps = table.batch_tokens, table.steps_per_sec
    from dsparkctl.plots import plot_sps

    plot_sps(bt, sps, png, f"{tgt.name} on {dev} ({dt}), context {context_len}, {measure.value}")
    save_sps_table(table, sg, fmt="sglang")
    save_sps_table(table, out_path, fmt="dsparkctl")  # ours last: its presence means all three were written
    result = {"table": str(out_path), "sglang_table": str(sg), "plot": str(png), "measures": measure.value,
              "batch_tokens": bt, "steps_per_sec": [round(s, 3) for s in sps],
              "ms_per_step": [round(1000 / s, 3) for s in sps], "grid": table.grid.to_json(), "warnings": warnings}
    if json_out:
        print_json(result)
        return
    t = Table(title=f"SPS of {tgt.name}, {measure.value} ({dev}, context {context_len}, median of {repeats})",
              title_justify="left")
    for c in ("batch tokens", "steps/s", "ms/step"):
        t.add_column(c, justify="right")
    for b, s in zip(bt, sps):
        t.add_row(str(b), f"{s:.2f}", f"{1000 / s:.2f}")
    out.print(t)
    g = table.grid
    gt = Table(title="fitted step time, ms (requests × tokens per request; plain = no draft)", title_justify="left")
    for c in ("requests", *map(str, g.tokens), *(("plain",) if g.plain_ms else ())):
        gt.add_column(c, justify="right")
    for i, r in enumerate(g.requests):
        gt.add_row(str(r), *(f"{v:.2f}" for v in g.step_ms[i]), *((f"{g.plain_ms[i]:.2f}",) if g.plain_ms else ()))
    out.print(gt)
    out.print(f"wrote {out_path}, {sg}, {png}", highlight=False)
