"""`serve-config`: what a user pastes to serve a (tuned) draft in SGLang or vLLM.

Reads and resolves the tuning files (SPS table, calibration, sweep) before any model loads,
exports the drafts each engine reads (a full-vocabulary copy for SGLang, vLLM's reduced form),
builds the launch line and vLLM's config (serving/engines.py) and writes the script, all or none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs, local_inputs
from dsparkctl.engine.session import open_session
from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.files.atomic import atomic_open
from dsparkctl.files.commit import transaction
from dsparkctl.formats.calibration import calibration_draft_notes
from dsparkctl.formats.sglang import check_our_sps, check_sglang_sps, check_sts, sglang_file
from dsparkctl.models.draft_io import check_draft_destination, save_draft, save_draft_for_vllm
from dsparkctl.models.loading import RANDOM_DRAFT, default_draft_dir, is_default_draft, is_embedded
from dsparkctl.serving.engines import (RAGGED_ENV, check_sweep_draft, k_table_from_sweep, sglang_command, sweep_notes,
                                      vllm_config)
from dsparkctl.serving.shell import (SCRIPT_HEADER, check_script_destination, check_target_id,
                                     refuse_control_characters, shell_line)
from dsparkctl.serving.vocab import expand_vocabulary
from dsparkctl.strict_json import read
from dsparkctl.tuning.sweep import DEFAULT_CONCURRENCY, sweep_traces


def _same_draft(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


@dataclass(frozen=True)
class ServeInputs:
    """The tuning files serve-config names, read and resolved before any model loads."""
    sps_file: Path | None = None  # the SGLang table the server reads
    sps_draft: str | None = None  # the draft our table was profiled with (None: SGLang's own file)
    sts_file: Path | None = None
    sweep: Any = None  # the parsed sweep document
    sps_block_size: int | None = None  # the block size our table was profiled with (None: it does not say)


def read_serve_inputs(sps_table: Path | None, calibration: Path | None, sweep: Path | None,
                      served: Path | None = None) -> ServeInputs:

    sps_file = sglang_file(sps_table, "sps") if sps_table else None
    if sps_file:
        check_sglang_sps(sps_file)
    sps_draft, sps_gamma = check_our_sps(sps_table) if sps_table and sps_file != sps_table else (None, None)
    swept = read(sweep, "sweep result", "write one with `dsparkctl sweep-scheduler --out`") if sweep else None
    if served is not None:  # the length table re-derived from what the engine served: static:0..γ per load
        swept = sweep_traces((), sps_table, None, DEFAULT_CONCURRENCY, served=served)
    if swept is not None:  # its rows, before anything is exported (the block size is checked with the draft)
        k_table_from_sweep(swept, block_size=None)
    return ServeInputs(sps_file=sps_file, sps_draft=sps_draft, sps_block_size=sps_gamma,
                       sts_file=sglang_file(calibration, "sts") if calibration else None, sweep=swept)


def _local(path: str) -> str:
    """A local path made absolute (the commands may run from anywhere); a hub id as it is."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def export_drafts(sess: Any, export_full_vocab: Path | None, export_vllm: Path | None) -> dict[str, str]:
    """A reduced-vocabulary draft written per engine: the full-vocabulary copy for SGLang (vLLM
    loads it too) and, if asked, vLLM's own reduced form. Returns {engine: folder}."""

    d = sess.draft
    if d.draft_vocab_ids is None:
        if export_full_vocab is not None or export_vllm is not None:
            given = option("export_full_vocab" if export_full_vocab is not None else "export_vllm")
            raise UsageError(f"{given} is for reduced-vocabulary drafts; this one covers the full vocabulary",
                             "drop it: both engines read this draft folder as it is")
        return {}
    K = d.cfg.draft_vocab_size
    if export_full_vocab is None:
        raise UsageError(f"{sess.draft_name} has a reduced vocabulary ({K} ids); SGLang reads only a "
                         "full-vocabulary copy (it uses the target's head) and vLLM its own reduced form",
                         f"add {option('export_full_vocab')} DIR (for SGLang; vLLM loads it too) and optionally "
                         f"{option('export_vllm')} DIR (vLLM's reduced form, a smaller head)")
    save_draft(expand_vocabulary(d, sess.adapter), export_full_vocab, overwrite=True, extra_config={
        "dsparkctl": {"expanded_from": sess.draft_name, "engine": "sglang",
                      "note": "full-vocabulary copy of a reduced-vocabulary draft, for SGLang (vLLM loads it too)"}})
    out = {"sglang": str(export_full_vocab.resolve())}
    if export_vllm is not None:
        save_draft_for_vllm(d, export_vllm, overwrite=True, extra_config={
            "dsparkctl": {"exported_from": sess.draft_name, "engine": "vllm",
                          "note": f"vLLM's reduced-vocabulary form (d2t [{K}], lm_head [{K}, hidden]); SGLang cannot "
                                  "read it, use the full-vocabulary copy there"}})
        out["vllm"] = str(export_vllm.resolve())
    return out


def plan_serving(sess: Any, draft: str | None, target: str | None, target_id: str | None, files: ServeInputs,
                 export_full_vocab: Path | None, export_vllm: Path | None = None) -> dict[str, Any]:
    """The SGLang command (with its environment and files) and vLLM's speculative config for the
    session's draft, plus the notes a user must read. Writes the per-engine exports of a
    reduced-vocabulary draft (`export_drafts`) if asked."""

    d = sess.draft
    gamma = d.block_size
    notes: list[str] = []
    if files.sps_draft and sess.draft_name and not _same_draft(files.sps_draft, sess.draft_name):
        notes.append(f"the SPS table was profiled with draft {files.sps_draft!r}, not {sess.draft_name!r}; "
                     "profile the one you serve")
    if files.sts_file:
        check_sts(files.sts_file, gamma)
        if not d.cfg.enable_confidence_head:
            raise InputError("the draft has no confidence head, so SGLang ignores an STS file",
                             f"drop {option('calibration')}, or serve a draft with a confidence head")
    draft_path = _local(draft) if not is_default_draft(draft) else str(default_draft_dir())
    exports = export_drafts(sess, export_full_vocab, export_vllm)
    sglang_draft = exports.get("sglang", draft_path)
    vllm_draft = exports.get("vllm", sglang_draft)
    if exports:
        K, V = d.cfg.draft_vocab_size, d.cfg.vocab_size
        notes.append(f"SGLang: wrote the full-vocabulary copy {export_full_vocab}; measure it with "
                     f"`dsparkctl eval-acceptance --draft {export_full_vocab}` (tokens outside the subset now "
                     "get draft mass)")
        if "vllm" in exports:
            notes.append(f"vLLM: wrote its reduced-vocabulary form {export_vllm} (d2t + lm_head [{K}, hidden]: "
                         f"the same draft as {sess.draft_name}, its head {K}/{V} of the full one's cost)")
        else:
            notes.append(f"vLLM: the command uses the full-vocabulary copy; --export-vllm DIR writes vLLM's reduced "
                         f"form instead (head {K}/{V} of the cost, the draft's own acceptance)")
    tid = target_id or (_local(target) if not is_embedded(target) else None) or (
        "HuggingFaceTB/SmolLM2-135M-Instruct" if sess.embedded_target else "TARGET")
    dspark = d.cfg.markov_rank > 0
    env, argv = sglang_command(tid, sglang_draft, gamma, dspark,
                               str(files.sps_file.resolve()) if files.sps_file else None,
                               str(files.sts_file.resolve()) if files.sts_file else None)
    if files.sweep is not None:
        check_sweep_draft(files.sweep, gamma, d.fingerprint())
    if files.sps_block_size is not None and files.sps_block_size != gamma:
        raise InputError(f"the SPS table was profiled with a draft of block size {files.sps_block_size}; this "
                         f"draft's is {gamma}", "profile the draft you serve: `dsparkctl profile-sps --draft ...`")
    k_table = k_table_from_sweep(files.sweep, gamma) if files.sweep is not None else None
    if k_table:
        notes += sweep_notes(files.sweep, gamma, k_table)
    vllm = vllm_config(vllm_draft, gamma, k_table)
    vllm_argv = ["vllm", "serve", tid, "--speculative-config", json.dumps(vllm, separators=(",", ":"))]
    if not dspark:
        notes.append("the draft has no Markov head (DFlash): SGLang serves it with DFLASH; vLLM's dspark method "
                     "expects a DSpark draft")
    if dspark and not (files.sps_file or files.sts_file):
        notes.append(f"without --sps-table/--calibration SGLang runs {env.get(RAGGED_ENV, 'static')} "
                     "verification (every draft verified)")
    return {
        "draft": sglang_draft, "target": tid, "block_size": gamma, "kind": d.cfg.kind,
        "exports": exports,
        "sglang": {"draft": sglang_draft, "env": env, "argv": argv, "command": shell_line(env, argv),
                   "files": {"sps_table": str(files.sps_file.resolve()) if files.sps_file else None,
                             "sts": str(files.sts_file.resolve()) if files.sts_file else None}},
        "vllm": {"draft": vllm_draft, "speculative_config": vllm, "argv": vllm_argv,
                 "command": shell_line({}, vllm_argv)},
        "notes": notes,
    }


def write_script(path: Path, result: dict[str, Any]) -> None:
    """Both commands as a shell script (SGLang's runs; vLLM's is commented), written atomically."""

    with atomic_open(path, "w") as fh:
        fh.write(SCRIPT_HEADER + "# SGLang:\n")
        fh.write(result["sglang"]["command"] + "\n# vLLM:\n# " + result["vllm"]["command"] + "\n")
    result["script"] = str(path)


@dataclass(frozen=True)
class ServeSpec:
    """Everything `serve-config` runs, as the user gave it (`run_serve_config` checks it)."""
    draft: str | None = None  # folder or hub id; None: the shipped draft (embedded target only); not "random"
    target: str | None = None  # folder or hub id; None: the embedded model
    target_id: str | None = None  # the target as the server names it; None: target, or the embedded model's hub id
    revision: str | None = None
    sps_table: Path | None = None  # profile-sps output (ours, or the .sglang.json beside it)
    calibration: Path | None = None  # calibrate output (ours, or the .sglang-sts.json); None: the draft's own
    sweep: Path | None = None  # sweep-scheduler --out result: vLLM's length per batch size
    served: Path | None = None  # or `dsparkctl served --out`: the lengths re-derived from served acceptance
    export_full_vocab: Path | None = None  # a reduced-vocabulary draft's full-vocabulary copy (SGLang) goes here
    export_vllm: Path | None = None  # and vLLM's reduced form here (needs export_full_vocab)
    out: Path | None = None  # also write a shell script with both commands


def check_serve_spec(spec: ServeSpec) -> None:
    """Every check that needs no model and reads no tuning file: the outputs, the draft, the
    exports' pairing, and every name that reaches the commands and the script."""

    check_outputs([o for o in (Output(spec.out, option("out")) if spec.out else None,
                               Output(spec.export_full_vocab, option("export_full_vocab"), "folder")
                               if spec.export_full_vocab else None,
                               Output(spec.export_vllm, option("export_vllm"), "folder") if spec.export_vllm else None)
                   if o is not None],
                  local_inputs(spec.sps_table, spec.calibration, spec.sweep, spec.served, target=spec.target,
                               drafts=[spec.draft]))
    if spec.served is not None and (spec.sweep is not None or spec.sps_table is None):
        raise UsageError(f"{option('served')} re-derives vLLM's length table in place of {option('sweep')}, and "
                         f"prices each length with {option('sps_table')}",
                         f"drop {option('sweep')}" if spec.sweep is not None else f"add {option('sps_table')} FILE "
                         "(`dsparkctl profile-sps --out`)")
    if spec.draft == RANDOM_DRAFT:
        raise UsageError(f"{option('draft')} random is an untrained draft: there is nothing to serve",
                         f"pass a trained draft folder or hub id (or omit {option('draft')} for the shipped one)")
    if is_default_draft(spec.draft) and not is_embedded(spec.target):
        raise UsageError(f"serve-config needs {option('draft')} for this target: the shipped draft is the embedded "
                         "target's", "pass the draft folder or hub id you will serve")
    if spec.export_vllm is not None and spec.export_full_vocab is None:
        raise UsageError(f"{option('export_vllm')} comes with {option('export_full_vocab')}: SGLang's command needs "
                         "the full-vocabulary copy (it cannot read vLLM's reduced form)",
                         f"add {option('export_full_vocab')} DIR")
    if spec.target_id is not None:
        check_target_id(spec.target_id)
    for name in ("target", "draft", "sps_table", "calibration", "export_full_vocab"):
        value = getattr(spec, name)
        if value is not None:  # they reach the commands and the script: refused before the models load
            p = Path(value).expanduser()
            refuse_control_characters(option(name), str(p.resolve()) if str(value) and p.exists() else str(value))
    if spec.out is not None:
        check_script_destination(spec.out)
    for folder in (spec.export_full_vocab, spec.export_vllm):
        if folder is not None:
            check_draft_destination(folder, overwrite=True)


def run_serve_config(spec: ServeSpec, *, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Check the spec (`check_serve_spec`) and read the tuning files before any model loads, then
    open target and draft on the CPU and plan both engines (`plan_serving`: the per-engine exports
    of a reduced-vocabulary draft are written if asked) and write the script `spec.out`. Returns
    the serve-config document, its notes led by what the calibration's draft check said.

    Without `spec.calibration` the draft's own `calibration.json` is used, with a note, when it was
    fitted for this very draft (`calibrate.own_calibration`, the rule generate and eval-acceptance
    follow)."""
    import dataclasses

    check_serve_spec(spec)
    files = read_serve_inputs(spec.sps_table, spec.calibration, spec.sweep, spec.served)  # before the models load
    sess = open_session(spec.target, spec.draft, "cpu", "fp32", spec.revision, log=log)
    cal_notes: list[str] = []
    if spec.calibration is not None:
        cal_notes = calibration_draft_notes(spec.calibration, sess.draft.fingerprint())
    elif (own := sess.default_calibration()) is not None:
        files = dataclasses.replace(files, sts_file=sglang_file(own, "sts"))
        cal_notes = [f"the confidences are calibrated with the draft's own {own} (--calibration to override)"]
    with transaction():  # both exports and the script appear together, or none (files.commit)
        result = plan_serving(sess, spec.draft, spec.target, spec.target_id, files, spec.export_full_vocab,
                              spec.export_vllm)
        result["notes"] = cal_notes + result["notes"]
        if spec.out is not None:
            write_script(spec.out, result)
    return result
