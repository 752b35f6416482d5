"""`dsparkctl serve-config` (the SGLang launch line and vLLM speculative config for a draft) and
`dsparkctl served` (the acceptance an engine served, beside our offline measurement)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from dsparkctl.cli.console import err, note, out, print_json, progress_bar, styled
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import DraftOpt, JsonOpt, RevisionOpt, TargetOpt, int_list


def register(app: typer.Typer) -> None:
    app.command("serve-config", help="Print (and optionally write) how to serve a draft: the SGLang launch command "
                "with its environment and tuning files, and vLLM's --speculative-config.")(serve_config)
    app.command("served", help="Read the acceptance a running vLLM or SGLang server reports: τ and acceptance per "
                "draft position; with --offline, whether it agrees with ours.")(served)


@guarded
def serve_config(
    draft: DraftOpt = None,
    target: TargetOpt = None,
    target_id: Annotated[Optional[str], typer.Option("--target-id", help="The target as the server names it (hub id or "
                                                     "path); default: --target, or the embedded model's hub id.")] = None,
    revision: RevisionOpt = None,
    sps_table: Annotated[Optional[Path], typer.Option("--sps-table", help="Steps-per-second table from profile-sps "
                                                      "(ours or the .sglang.json beside it).")] = None,
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="Calibration from calibrate (calib.json or "
                                                        "the .sglang-sts.json beside it).")] = None,
    sweep: Annotated[Optional[Path], typer.Option("--sweep", help="sweep-scheduler --out result: gives vLLM a draft "
                                                  "length per batch size (the best static:K at each load).")] = None,
    served: Annotated[Optional[Path], typer.Option("--served", help="`dsparkctl served --out` document: re-derive "
                                                   "vLLM's length table from the acceptance the engine served "
                                                   "(priced with --sps-table), in place of --sweep.")] = None,
    export_full_vocab: Annotated[Optional[Path], typer.Option("--export-full-vocab", help="For a reduced-vocabulary "
                                                              "draft: write its full-vocabulary copy here, for SGLang "
                                                              "(which uses the target's head); vLLM loads it too.")] = None,
    export_vllm: Annotated[Optional[Path], typer.Option("--export-vllm", help="For a reduced-vocabulary draft: also "
                                                        "write vLLM's reduced-vocabulary form here, for vLLM's config "
                                                        "(SGLang cannot read it).")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Also write a shell script with both commands.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.app.serve_config import ServeSpec, run_serve_config

    spec = ServeSpec(draft=draft, target=target, target_id=target_id, revision=revision, sps_table=sps_table,
                     calibration=calibration, sweep=sweep, served=served, export_full_vocab=export_full_vocab,
                     export_vllm=export_vllm, out=out_path)
    result = run_serve_config(spec, log=lambda m: err.print(styled((m, "dim"))))
    if json_out:
        print_json(result)
        return
    out.print(styled(("SGLang", "bold")))
    out.print(result["sglang"]["command"], highlight=False, soft_wrap=True)
    out.print(styled(("vLLM", "bold")))
    out.print(result["vllm"]["command"], highlight=False, soft_wrap=True)
    for n in result["notes"]:
        note(n)


@guarded
def served(
    sources: Annotated[list[str], typer.Argument(help="A metrics URL (http://HOST:PORT/metrics), a saved "
                                                 "Prometheus scrape (give two, earlier first, for the window between "
                                                 "them), or JSON-lines files of response bodies (vLLM's per-request "
                                                 "metrics or SGLang's meta_info).")],
    offline: Annotated[Optional[Path], typer.Option("--offline", help="Our own measurement with the same draft, "
                                                    "target and sampling (eval-acceptance --json output or a "
                                                    "generate --trace file), to compare position by position.")] = None,
    offline_dataset: Annotated[Optional[str], typer.Option("--offline-dataset", help="The dataset of the offline "
                                                           "document to compare (when it holds several).")] = None,
    offline_draft: Annotated[Optional[str], typer.Option("--offline-draft", help="The draft label of the offline "
                                                         "document to compare (when it holds several).")] = None,
    offline_measure: Annotated[Optional[str], typer.Option("--offline-measure", help="live or teacher-forced "
                                                           "(default: live where the document has it).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="The served model name, where a scrape or the "
                                                 "responses hold several.")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Write the served document here (for "
                                                     "sweep-scheduler / serve-config --served).")] = None,
    fail_on_mismatch: Annotated[bool, typer.Option("--fail-on-mismatch", help="Exit 1 unless every position "
                                                   "agrees with --offline.")] = False,
    context_buckets: Annotated[Optional[str], typer.Option("--context-buckets", metavar="EDGES", help="Comma-separated "
                                                           "prompt lengths, e.g. 256,1024: the acceptance per "
                                                           "context bucket too (response files only).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Read the acceptance an engine served; with --offline, say per position whether it agrees."""
    from dsparkctl.app.served import ServedSpec, run_served

    spec = ServedSpec(sources=tuple(sources), offline=offline, offline_dataset=offline_dataset,
                      offline_draft=offline_draft, offline_measure=offline_measure, model=model, out=out_path,
                      fail_on_mismatch=fail_on_mismatch,
                      context_buckets=tuple(int_list(context_buckets, "--context-buckets", maximum=2 ** 31 - 1))
                      if context_buckets is not None else ())
    with progress_bar("reading the trace", None, transfer=True) as update:
        doc = run_served(spec, log=lambda m: err.print(styled((m, "dim"))),
                         progress=lambda done, total: update(completed=done, total=total))
    if json_out:
        print_json(doc)
    else:
        _print_served(doc)
    if fail_on_mismatch and doc.get("parity", {}).get("verdict") != "agree":
        raise typer.Exit(1)


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def _ci(ci: list[float] | None) -> str:
    return "—" if not ci or ci[0] is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _print_served(doc: dict) -> None:
    src = doc["source"]["kind"]
    head = (f"{doc['engine']} {src}: " + (f"{doc['drafts']} drafted steps" if doc["drafts"] else "no counts")
            + (f", {doc['requests']} requests" if doc["requests"] else "")
            + (f", model {doc['model']}" if doc["model"] else "") + f"; draft lengths {doc['lengths']}")
    out.print(head, highlight=False)
    out.print(f"τ {_f(doc['tau'])} {_ci(doc['tau_interval'])} (bonus token included); draft acceptance rate "
              f"{_f(doc['draft_acceptance_rate'])}", highlight=False)
    if doc["per_position"]:
        t = Table(title="Per position (conditional: exact where identified, else [bounds] on it)")
        for col in ("pos", "accepted", "share of drafts", "conditional", "95% interval", "survival"):
            t.add_column(col, justify="right")
        for p in doc["per_position"]:
            cond = (_f(p["conditional"]) if p["identified"] else
                    f"[{_f(p['conditional_bounds'][0])}, {_f(p['conditional_bounds'][1])}]"
                    if p["conditional_bounds"] else "—")
            surv = (_f(p["survival"]) if p["survival"] is not None else
                    f"[{_f(p['survival_bounds'][0])}, {_f(p['survival_bounds'][1])}]" if p["survival_bounds"] else "—")
            t.add_row(str(p["position"]), str(p["accepted"]), _f(p["accepted_share"]), cond,
                      _ci(p["conditional_interval"]), surv)
        out.print(t)
    par = doc.get("parity")
    if par:
        o = par["offline"]
        t = Table(title=f"Parity with offline {o['label']!s} ({o['measure']}, {o['dataset']!s}, T={o['temperature']!s}): "
                        f"verdict {par['verdict']}")
        for col in ("pos", "offline", "offline 95%", "served", "served 95%", "agree"):
            t.add_column(col, justify="right")
        for r in par["positions"]:
            srv = _f(r["served"]) if r["served_identified"] else (
                f"[{_f(r['served_bounds'][0])}, {_f(r['served_bounds'][1])}]" if r["served_bounds"] else "—")
            t.add_row(str(r["position"]), _f(r["offline"]), _ci(r["offline_interval"]), srv,
                      _ci(r["served_interval"]), {True: "yes", False: f"NO ({r['side']})", None: "—"}[r["agree"]])
        out.print(t)
        out.print(f"τ offline {_f(o['tau'])} {_ci(o['tau_interval'])}, served {_f(par['served_tau'])} "
                  f"{_ci(par['served_tau_interval'])}", highlight=False)
        for i, c in enumerate(par["causes"], 1):
            out.print(f"likely cause {i}: {c['text']}", highlight=False)
    if "by_context" in doc:
        t = Table(title="by prompt length (conditional acceptance per position; — where not identified)",
                  title_justify="left")
        for c in ("prompt tokens", "responses", "drafted steps", "τ", *(f"c{k + 1}" for k in range(doc["positions"] or 0))):
            t.add_column(c, justify="right")
        for b in doc["by_context"]:
            lo, hi = b["prompt_tokens"]
            t.add_row(f"{lo}..{hi if hi is not None else ''}", str(b["responses"]), str(b.get("drafts") or "—"),
                      _f(b.get("tau")), *(_f(r["conditional"]) for r in b.get("per_position")
                                           or [{"conditional": None}] * (doc["positions"] or 0)))
        out.print(t)
    for n in doc["notes"]:
        note(n)
