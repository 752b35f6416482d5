"""`dsparkctl eval-acceptance`: teacher-forced and/or live acceptance of one or more drafts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from dsparkctl.cli.console import err, note, out, print_json
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import (CpuKernels, CpuKernelsOpt, DraftWeights, DraftWeightsOpt, Device, DeviceOpt, DType, DTypeOpt, JsonOpt,
                                   MaxNewTokensOpt, PresetOpt, RevisionOpt, SeedOpt, TargetOpt, TargetParallelOpt,
                                   TemperatureOpt, TrustRemoteCodeOpt, choices)
from dsparkctl.evaluation.acceptance import MODES

Mode = choices("Mode", MODES)


def register(app: typer.Typer) -> None:
    app.command("eval-acceptance", help="Measure how often the target accepts each draft position on real prompt "
                "sets: teacher-forced (scored on the target's own continuations, fast), live (real speculative decoding, every drafted "
                "token verified), or both.")(eval_acceptance)


def _fmt(v: Any, ci: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{v:.3f}"


def result_table(dataset: str, label: str, r: dict[str, Any]) -> Table:
    modes = [(m, r[k]) for m, k in (("live", "live"), ("TF", "teacher_forced")) if k in r]
    head = "  ".join(f"{m} τ {x['tau']:.3f}" if x.get("tau") is not None else f"{m} τ -" for m, x in modes)
    t = Table(title=f"{dataset} · {label} ({r['kind']}, γ={r['block_size']})  {head}", title_justify="left")
    t.add_column("position", justify="right")
    for m, x in modes:
        unit = "prompts" if m == "TF" or x.get("interval_unit") == "prompt" else "rounds"  # TF: clustered by prompt
        t.add_column(f"{m} conditional c_j [95% CI over {unit}]", justify="right")
        t.add_column(f"{m} survival a_j [95% CI over {unit}]", justify="right")
    agree = {a["position"]: a for a in r.get("agreement", {}).get("positions", [])}
    if agree:
        t.add_column("agree", justify="center")
    for j in range(r["block_size"]):
        row = [str(j + 1)]
        for _, x in modes:
            row += [_fmt(x["conditional"][j], x["conditional_interval"][j]),
                    _fmt(x["survival"][j], x["survival_interval"][j])]
        if agree:
            w = agree.get(j + 1, {}).get("within")
            row.append("-" if w is None else ("yes" if w else "NO"))
        t.add_row(*row)
    return t


@guarded(fields={"drafts": "draft"})
def eval_acceptance(
    draft: Annotated[Optional[list[str]], typer.Option("--draft", help="Draft model: folder or "
                                                       "hub id (default: the shipped draft); repeat to compare "
                                                       "several: --draft A --draft B.")] = None,
    target: TargetOpt = None,
    dataset: Annotated[Optional[list[str]], typer.Option("--dataset", help="Prompt set: mt-bench, humaneval, sharegpt, "
                                                         "a local file or a hub dataset id (default: mt-bench); "
                                                         "repeat for several: --dataset mt-bench --dataset "
                                                         "humaneval.")] = None,
    field: Annotated[Optional[str], typer.Option("--field", help="Which field holds the prompt in a local file or hub dataset.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Use only the first N prompts of each set.")] = None,
    temperature: TemperatureOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    preset: PresetOpt = None,
    mode: Annotated[Mode, typer.Option("--mode", help="teacher-forced, live, or both (teacher-forced then scores "
                                          "the live outputs).")] = Mode.both,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Requests decoded together.")] = 8,
    labels: Annotated[Optional[list[str]], typer.Option("--label", help="Display name for each --draft, in the same "
                                                         "order; repeat: --label A --label B.")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of acceptance per position here.")] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write live round traces (one file per dataset "
                                                  "and draft when there are several).")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Also write the JSON result here.")] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap prompts in the target's chat template.")] = True,
    lookup: Annotated[bool, typer.Option("--lookup/--no-lookup", help="Greedy only: measure with context lookup, "
                                         "as generate runs it (see generate --help); the draft's own figures are "
                                         "kept beside.")] = False,
    revision: RevisionOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    target_parallel: TargetParallelOpt = "none",
    cpu_kernels: CpuKernelsOpt = CpuKernels.auto,
    draft_weights: DraftWeightsOpt = DraftWeights.auto,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.app.eval_acceptance import EvalSpec, run_eval_acceptance

    spec = EvalSpec(drafts=tuple(draft or ()), labels=tuple(labels or ()), target=target,
                    datasets=tuple(dataset or ["mt-bench"]), field=field, limit=limit, preset=preset,
                    temperature=temperature, max_new_tokens=max_new_tokens, mode=mode.value, batch_size=batch_size,
                    chat=chat, lookup=lookup, plot=plot, trace=trace, out=out_path, revision=revision,
                    trust_remote_code=trust_remote_code, target_parallel=target_parallel,
                    cpu_kernels=cpu_kernels.value, draft_weights=draft_weights.value, device=device.value, dtype=dtype.value, seed=seed)
    results = run_eval_acceptance(spec, log=lambda s: err.print(s, highlight=False),
                             note=note)
    if json_out:
        print_json(results)
    else:
        print_results(results)



def confidence_line(conf: dict[str, Any]) -> str:
    """The confidence head on the live rounds, per position: AUROC and ECE raw → with the draft's calibration."""
    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    def num(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    cal = conf["positions"][0]["calibrated"] is not None
    parts = [f"{p['position']}: AUROC {num(p['raw']['auroc'])}, ECE {pct(p['raw']['ece'])}"
             + (f" → {pct(p['calibrated']['ece'])}" if cal else "") for p in conf["positions"]]
    how = f"ECE raw → with {conf['calibration']}" if cal else "raw (the draft has no calibration.json of its own)"
    return f"  confidence head on {conf['rounds']} live rounds ({how}): " + "; ".join(parts)


def print_results(results: dict[str, Any]) -> None:
    """One table per dataset and draft, how much faster teacher-forced scoring was than live, the plot."""
    for ds, dres in results["datasets"].items():
        for label, r in dres["drafts"].items():
            out.print(result_table(ds, label, r))
            conf = (r.get("live") or {}).get("confidence")
            if conf:
                out.print(confidence_line(conf), markup=False, highlight=False)
            if r.get("speed_ratio_live_over_tf"):
                out.print(f"  per evaluated position: live {r['live']['ms_per_position']:.3f} ms, teacher-forced "
                          f"{r['teacher_forced']['ms_per_position']:.3f} ms ({r['speed_ratio_live_over_tf']:.1f}x)")
    if "plot" in results:
        out.print(f"plot: {results['plot']}")
