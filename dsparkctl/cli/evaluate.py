"""`dsparkctl eval-acceptance`: teacher-forced and/or live acceptance of one or more drafts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from dsparkctl.cli.common import (CpuKernels, CpuKernelsOpt, DeviceOpt, DType, DTypeOpt, Device, JsonOpt, MaxNewTokensOpt, PresetOpt, RevisionOpt,
                                  SeedOpt, TargetOpt, TargetParallelOpt, TemperatureOpt, TrustRemoteCodeOpt, err,
                                  guarded, out, print_json, with_preset)
from dsparkctl.cli.common import choices
from dsparkctl.errors import UsageError
from dsparkctl.evaluation.run import MODES


Mode = choices("Mode", MODES)


def register(app: typer.Typer) -> None:
    app.command("eval-acceptance", help="Per-position acceptance of drafts on real prompt sets: teacher-forced "
                "analytic β (fast), live rollouts with static:γ, or both.")(eval_acceptance)


def _fmt(v: Any, ci: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{v:.3f}"


def result_table(dataset: str, label: str, r: dict[str, Any]) -> Table:
    modes = [(m, r[k]) for m, k in (("live", "live"), ("TF", "teacher_forced")) if k in r]
    head = "  ".join(f"{m} τ {x['tau']:.3f}" if x.get("tau") is not None else f"{m} τ -" for m, x in modes)
    t = Table(title=f"{dataset} · {label} ({r['kind']}, γ={r['block_size']})  {head}", title_justify="left")
    t.add_column("position", justify="right")
    for m, _ in modes:
        t.add_column(f"{m} conditional c_j [95% CI]", justify="right")
        t.add_column(f"{m} survival a_j [95% CI]", justify="right")
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


@guarded
def eval_acceptance(
    draft: Annotated[Optional[list[str]], typer.Option("--draft", help="Draft folder or hub id; repeat to compare "
                                                       "side by side (default: the shipped draft).")] = None,
    target: TargetOpt = None,
    dataset: Annotated[Optional[list[str]], typer.Option("--dataset", help="mt-bench, humaneval, sharegpt, a local file "
                                                         "or a hub id; repeat for several panels.")] = None,
    field: Annotated[Optional[str], typer.Option("--field", help="Prompt field for local files / hub datasets.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="First N prompts of each set.")] = None,
    temperature: TemperatureOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    preset: PresetOpt = None,
    mode: Annotated[Mode, typer.Option("--mode", help="teacher-forced, live, or both (TF reuses the live outputs).")] = Mode.both,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Requests decoded together.")] = 8,
    labels: Annotated[Optional[list[str]], typer.Option("--label", help="Display name per --draft (same order).")] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a Figure-2-style PNG here.")] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Write live round traces (one file per dataset "
                                                  "and draft when there are several).")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Also write the JSON result here.")] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="Wrap prompts in the target's chat template.")] = True,
    revision: RevisionOpt = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    target_parallel: TargetParallelOpt = "none",
    cpu_kernels: CpuKernelsOpt = CpuKernels.auto,
    device: DeviceOpt = Device.auto,
    dtype: DTypeOpt = DType.auto,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.cli.checks import Output, check_outputs, local_inputs
    from dsparkctl.data.prompts import apply_preset_wrap, encode_prompts, load_prompts
    from dsparkctl.distributed import world
    from dsparkctl.engine.session import open_target
    from dsparkctl.evaluation.run import EvalOptions, drafts_under_test, evaluate_acceptance, trace_paths
    from dsparkctl.fsutil import write_json
    from dsparkctl.math.sampling import SamplingParams

    preset, temperature, max_new_tokens = with_preset(preset, temperature, max_new_tokens)
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    datasets = dataset or ["mt-bench"]
    if labels and len(labels) != len(draft or []):
        raise UsageError("--label must be given once per --draft")
    inputs = local_inputs(*datasets, target=target, drafts=draft or [None])
    check_outputs([o for o in (Output(out_path, "--out") if out_path else None,
                               Output(plot, "--plot", kind="figure") if plot else None,
                               Output(trace, "--trace") if trace else None) if o is not None], inputs)
    # prompts first: bad prompt files fail before any model loads
    texts = {ds: apply_preset_wrap(preset, ds, load_prompts(ds, field, limit)) for ds in datasets}
    sess = open_target(target, device.value, dtype.value, revision, trust_remote_code,
                       log=lambda s: err.print(s, markup=False),
                       parallel=target_parallel, cpu_kernels=cpu_kernels.value, settle=False)
    drafts, notes = drafts_under_test(sess, draft or [None], labels, revision, seed)
    if trace is not None and mode != Mode.teacher_forced:  # the per-pair files, checked like --trace
        check_outputs([Output(p, "--trace") for p in trace_paths(trace, datasets, [d.label for d in drafts]).values()],
                      inputs)
    for n in notes:
        err.print(f"note: {n}")
    gamma = max(d.draft.block_size for d in drafts)
    if mode != Mode.live and max_new_tokens <= gamma:
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no full block of γ={gamma} to score "
                         "teacher-forced", f"use --max-new-tokens > {gamma}")
    lt = sess.target
    prompts = {ds: encode_prompts(lt.tokenizer, texts[ds], chat=chat) for ds in datasets}
    opts = EvalOptions(mode=mode.value, params=SamplingParams(temperature=temperature),
                       max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
                       trace=trace if mode != Mode.teacher_forced else None, preset=preset.name if preset else None)
    sess.settle_kernels(lambda s: err.print(s, markup=False), tuple(d.draft for d in drafts))  # inputs checked
    results = evaluate_acceptance(lt.model, lt.name, drafts, prompts, opts, sess.stop_ids,
                                  log=lambda s: err.print(s, highlight=False))
    if plot is not None:
        if world().main:
            from dsparkctl.evaluation.plot import plot_acceptance
            plot_acceptance(results, plot, title=f"{lt.name}, T={temperature}")
        results["plot"] = str(plot)
    if out_path is not None and world().main:
        write_json(out_path, results)
    if json_out:
        print_json(results)
        return
    print_results(results)
    if plot is not None:
        out.print(f"plot: {plot}")


def print_results(results: dict[str, Any]) -> None:
    """One table per dataset and draft, and how much faster teacher-forced scoring was than live."""
    for ds, dres in results["datasets"].items():
        for label, r in dres["drafts"].items():
            out.print(result_table(ds, label, r))
            if r.get("speed_ratio_live_over_tf"):
                out.print(f"  per evaluated position: live {r['live']['ms_per_position']:.3f} ms, teacher-forced "
                          f"{r['teacher_forced']['ms_per_position']:.3f} ms ({r['speed_ratio_live_over_tf']:.1f}x)")
