"""`dsparkctl serve-config`: the SGLang launch line and vLLM speculative config for a draft."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dsparkctl.cli.common import DraftOpt, JsonOpt, RevisionOpt, TargetOpt, err, guarded, out, print_json, styled
from dsparkctl.errors import UsageError


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
    from dsparkctl.checks import Output, check_outputs, local_inputs
    from dsparkctl.engine.session import open_session
    from dsparkctl.models.draft_io import check_draft_destination
    from dsparkctl.models.loading import RANDOM_DRAFT, is_default_draft, is_embedded
    from dsparkctl.serving import (check_script_destination, check_target_id, plan_serving,
                                   read_serve_inputs, refuse_control_characters, write_script)

    check_outputs([o for o in (Output(out_path, "--out") if out_path else None,
                               Output(export_full_vocab, "--export-full-vocab", "folder")
                               if export_full_vocab else None,
                               Output(export_vllm, "--export-vllm", "folder") if export_vllm else None)
                   if o is not None],
                  local_inputs(sps_table, calibration, sweep, target=target, drafts=[draft]))
    if draft == RANDOM_DRAFT:
        raise UsageError("--draft random is an untrained draft: there is nothing to serve",
                         "pass a trained draft folder or hub id (or omit --draft for the shipped one)")
    if is_default_draft(draft) and not is_embedded(target):
        raise UsageError("serve-config needs --draft for this target: the shipped draft is the embedded target's",
                         "pass the draft folder or hub id you will serve")
    if export_vllm is not None and export_full_vocab is None:
        raise UsageError("--export-vllm comes with --export-full-vocab: SGLang's command needs the "
                         "full-vocabulary copy (it cannot read vLLM's reduced form)", "add --export-full-vocab DIR")
    if target_id is not None:
        check_target_id(target_id)
    for what, value in (("--target", target), ("--draft", draft), ("--sps-table", sps_table),
                        ("--calibration", calibration), ("--export-full-vocab", export_full_vocab)):
        if value is not None:  # they reach the commands and the script: refused before the models load
            p = Path(value).expanduser()
            refuse_control_characters(what, str(p.resolve()) if str(value) and p.exists() else str(value))
    if out_path is not None:
        check_script_destination(out_path)
    for folder in (export_full_vocab, export_vllm):
        if folder is not None:
            check_draft_destination(folder, overwrite=True)
    own = None
    if calibration is None:  # the draft's own calibration, shipped beside it (checked against it below)
        from dsparkctl.calibrate import CALIBRATION_NAME
        from dsparkctl.models.loading import default_draft_dir

        folder = (default_draft_dir() if is_default_draft(draft) else
                  Path(draft).expanduser() if Path(draft).expanduser().is_dir() else None)
        if folder is not None and (folder / CALIBRATION_NAME).is_file():
            calibration = own = folder / CALIBRATION_NAME
    files = read_serve_inputs(sps_table, calibration, sweep)  # before the models load
    sess = open_session(target, draft, "cpu", "fp32", revision, log=lambda m: err.print(styled((m, "dim"))))
    if calibration is not None:
        from dsparkctl.calibrate import calibration_draft_notes
        from dsparkctl.errors import InputError

        try:
            cal_notes = calibration_draft_notes(calibration, sess.draft.fingerprint())
        except InputError:
            if own is None:
                raise
            import dataclasses

            cal_notes = [f"{own} is not this draft's calibration: not used"]
            files = dataclasses.replace(files, sts_file=None)
        if own is not None and files.sts_file is not None:
            cal_notes.append(f"the confidences are calibrated with the draft's own {own} (--calibration to override)")
    result = plan_serving(sess, draft, target, target_id, files, export_full_vocab, export_vllm)
    if calibration is not None:
        result["notes"] = cal_notes + result["notes"]
    if out_path is not None:
        write_script(out_path, result)
    if json_out:
        print_json(result)
        return
    out.print(styled(("SGLang", "bold")))
    out.print(result["sglang"]["command"], highlight=False, soft_wrap=True)
    out.print(styled(("vLLM", "bold")))
    out.print(result["vllm"]["command"], highlight=False, soft_wrap=True)
    for n in result["notes"]:
        err.print(styled(("note:", "yellow"), f" {n}"))
