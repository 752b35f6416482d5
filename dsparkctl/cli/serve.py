"""`dsparkctl serve-config`: the SGLang launch line and vLLM speculative config for a draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from dsparkctl.cli.common import DraftOpt, JsonOpt, RevisionOpt, TargetOpt, err, guarded, out, print_json, styled
from dsparkctl.errors import InputError, UsageError


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
                                                              "draft: write its full-vocabulary copy here (the "
                                                              "engines read no index map); the commands use it.")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", help="Also write a shell script with both commands.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from dsparkctl.cli.checks import Output, check_outputs, local_inputs
    from dsparkctl.engine.session import open_session
    from dsparkctl.models.draft_io import check_draft_destination, save_draft
    from dsparkctl.serving import (check_script_destination, check_sglang_sps, check_sts, check_target_id,
                                   expand_vocabulary, k_table_from_sweep, sglang_command, sglang_file, shell_line,
                                   sps_provenance_notes, vllm_config, SCRIPT_HEADER)
    from dsparkctl.strict_json import read

    inputs = local_inputs(target, draft, sps_table, calibration, sweep)
    check_outputs([o for o in (Output(out_path, "--out") if out_path else None,
                               Output(export_full_vocab, "--export-full-vocab", "folder")
                               if export_full_vocab else None) if o is not None], inputs)
    if draft == "random":
        raise UsageError("--draft random is an untrained draft: there is nothing to serve",
                         "pass a trained draft folder or hub id (or omit --draft for the shipped one)")
    if target_id is not None:
        check_target_id(target_id)
    if out_path is not None:
        check_script_destination(out_path)
    if export_full_vocab is not None:
        check_draft_destination(export_full_vocab, overwrite=True)
    sps_file = sglang_file(sps_table, "sps") if sps_table else None
    sts_file = sglang_file(calibration, "sts") if calibration else None
    sweep_doc = read(sweep, "sweep result", "write one with `dsparkctl sweep-scheduler --out`") if sweep else None
    sess = open_session(target, draft, "cpu", "fp32", revision, log=lambda m: err.print(styled((m, "dim"))))
    d = sess.draft
    gamma = d.block_size
    notes: list[str] = []
    if sps_file:
        check_sglang_sps(sps_file)
        if sps_file != sps_table:  # ours: it says what it measured and with which draft
            notes += sps_provenance_notes(sps_table, sess.draft_name)
    if sts_file:
        check_sts(sts_file, gamma)
        if not d.cfg.enable_confidence_head:
            raise InputError("the draft has no confidence head, so SGLang ignores an STS file",
                             "drop --calibration, or serve a draft with a confidence head")
    draft_path = draft if draft not in (None, "", "default") else None
    if draft_path is not None and Path(draft_path).expanduser().exists():
        draft_path = str(Path(draft_path).expanduser().resolve())  # the script may run from anywhere
    if d.draft_vocab_ids is not None:
        if export_full_vocab is None:
            raise UsageError(f"{sess.draft_name} has a reduced vocabulary ({d.cfg.draft_vocab_size} ids), which "
                             "SGLang and vLLM do not read", "add --export-full-vocab DIR to write a full-vocabulary "
                             "copy that they load")
        full = expand_vocabulary(d, sess.adapter)
        save_draft(full, export_full_vocab, overwrite=True, extra_config={"dsparkctl": {
            "expanded_from": sess.draft_name, "note": "full-vocabulary copy of a reduced-vocabulary draft"}})
        draft_path = str(export_full_vocab.resolve())
        notes.append(f"wrote the full-vocabulary copy {export_full_vocab}; measure it with "
                     f"`dsparkctl eval-acceptance --draft {export_full_vocab}` (tokens outside the subset now "
                     "get draft mass)")
    elif export_full_vocab is not None:
        raise UsageError("--export-full-vocab is for reduced-vocabulary drafts; this one covers the full vocabulary")
    if draft_path is None:
        from dsparkctl.models.loading import default_draft_dir
        draft_path = str(default_draft_dir())
    tid = target_id or target or ("HuggingFaceTB/SmolLM2-135M-Instruct" if sess.embedded_target else "TARGET")
    if target_id is None and target and Path(target).expanduser().exists():
        tid = str(Path(target).expanduser().resolve())
    dspark = d.cfg.markov_rank > 0
    env, argv = sglang_command(tid, draft_path, gamma, dspark, str(sps_file.resolve()) if sps_file else None,
                               str(sts_file.resolve()) if sts_file else None)
    k_table = k_table_from_sweep(sweep_doc, gamma) if sweep_doc is not None else None
    if k_table:
        notes.append(f"vLLM's length table: batch sizes above the largest swept concurrency "
                     f"({k_table[-1][0]}..{k_table[-1][1]}) reuse its length; sweep higher loads to measure them")
    vllm = vllm_config(draft_path, gamma, k_table)
    vllm_argv = ["vllm", "serve", tid, "--speculative-config", json.dumps(vllm, separators=(",", ":"))]
    if not dspark:
        notes.append("the draft has no Markov head (DFlash): SGLang serves it with DFLASH; vLLM's dspark method "
                     "expects a DSpark draft")
    if dspark and not (sps_file or sts_file):
        notes.append(f"without --sps-table/--calibration SGLang runs {env.get('SGLANG_RAGGED_VERIFY_MODE', 'static')} "
                     "verification (every draft verified)")
    result: dict[str, Any] = {
        "draft": draft_path, "target": tid, "block_size": gamma, "kind": d.cfg.kind,
        "sglang": {"env": env, "argv": argv, "command": shell_line(env, argv),
                   "files": {"sps_table": str(sps_file) if sps_file else None,
                             "sts": str(sts_file) if sts_file else None}},
        "vllm": {"speculative_config": vllm, "argv": vllm_argv, "command": shell_line({}, vllm_argv)},
        "notes": notes,
    }
    if out_path is not None:
        from dsparkctl.fsutil import atomic_open
        with atomic_open(out_path, "w") as fh:
            fh.write(SCRIPT_HEADER + "# SGLang:\n")
            fh.write(result["sglang"]["command"] + "\n# vLLM:\n# " + result["vllm"]["command"] + "\n")
        result["script"] = str(out_path)
    if json_out:
        print_json(result)
        return
    out.print(styled(("SGLang", "bold")))
    out.print(result["sglang"]["command"], highlight=False, soft_wrap=True)
    out.print(styled(("vLLM", "bold")))
    out.print(result["vllm"]["command"], highlight=False, soft_wrap=True)
    for n in notes:
        err.print(styled(("note:", "yellow"), f" {n}"))
