"""`dsparkctl serve-config`: the SGLang launch line and vLLM speculative config for a draft."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dsparkctl.cli.console import err, note, out, print_json, styled
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import DraftOpt, JsonOpt, RevisionOpt, TargetOpt


def register(app: typer.Typer) -> None:
    app.command("serve-config", help="Print (and write) what serves a draft in SGLang and vLLM: the SGLang launch "
                "command with its environment and tuning files, and vLLM's --speculative-config.")(serve_config)


@guarded
def serve_config(
    draft: DraftOpt = None,
    target: TargetOpt = None,
    target_id: Annotated[Optional[str], typer.Option("--target-id", help="The target as the server names it (hub id or "
                                                     "path); default: --target, or the embedded model's hub id.")] = None,
    revision: RevisionOpt = None,
    sps_table: Annotated[Optional[Path], typer.Option("--sps-table", help="profile-sps output (ours or the "
                                                      ".sglang.json beside it).")] = None,
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="calibrate output (ours or the "
                                                        ".sglang-sts.json beside it).")] = None,
    sweep: Annotated[Optional[Path], typer.Option("--sweep", help="sweep-scheduler --out result: vLLM's per-batch-"
                                                  "size length table from its best static:K per concurrency.")] = None,
    export_full_vocab: Annotated[Optional[Path], typer.Option("--export-full-vocab", help="For a reduced-vocabulary "
                                                              "draft: write its full-vocabulary copy here, for SGLang "
                                                              "(which uses the target's head); vLLM loads it too.")] = None,
    export_vllm: Annotated[Optional[Path], typer.Option("--export-vllm", help="For a reduced-vocabulary draft: also "
                                                        "write vLLM's reduced form here (d2t + lm_head [K, hidden], a "
                                                        "K/V head); vLLM's config uses it. SGLang cannot read it.")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Also write a shell script with both commands.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.app.serve_config import ServeSpec, run_serve_config

    spec = ServeSpec(draft=draft, target=target, target_id=target_id, revision=revision, sps_table=sps_table,
                     calibration=calibration, sweep=sweep, export_full_vocab=export_full_vocab,
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
