"""`inspect`: what a checkpoint or a draft folder holds, in its own terms and in the canonical ones.

A standalone draft folder of any known format (models/draft_formats) is described by the format
registry: format and version, conventions as written and canonical, vocabulary, dtypes, the target
it names. With `target`, the pair is checked from the configs before any forward; with `probe` N,
the slot convention and layer-id count are measured on N teacher-forced prompts
(evaluation/conventions.py). Anything else (a DeepSeek-V4.x checkpoint, a hub repo) is opened
by its headers only and reported by layout (checkpoint/inspect.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from transformers import AutoConfig

from dsparkctl.checkpoint.hub import open_checkpoint
from dsparkctl.checkpoint.inspect import inspect_report
from dsparkctl.data.prompts import encode_prompts, load_prompts
from dsparkctl.engine.session import open_target
from dsparkctl.errors import CheckpointError, UsageError, option
from dsparkctl.evaluation.continuations import cached_continuations
from dsparkctl.evaluation.conventions import probe
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models import draft_formats as formats
from dsparkctl.models.draft_formats.describe import describe, pair_findings
from dsparkctl.models.embedded import embedded_target_dir
from dsparkctl.models.loading import DEFAULT_DRAFT, default_draft_dir, is_embedded, resolve_folder

PROBE_TOKENS = 64  # new tokens per probe prompt: enough anchors for c₁, a few seconds on a CPU


@dataclass(frozen=True)
class InspectSpec:
    """What `inspect` reads: a local checkpoint or draft folder, or a hub repo id (at `revision`)."""
    source: str
    revision: str | None = None
    target: str | None = None  # check the draft against this target (folder, hub id or "embedded")
    probe: int = 0  # with target: measure the conventions on this many prompts of `dataset`
    dataset: str = "mt-bench"


def run_inspect(spec: InspectSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """`inspect` as one call (see the module doc)."""
    if spec.probe < 0:
        raise UsageError(f"{option('probe')} must be >= 0, got {spec.probe}", "use e.g. 4 (prompts)")
    if spec.probe and spec.target is None:
        raise UsageError(f"{option('probe')} measures the draft against its target", f"add {option('target')}")
    source = str(default_draft_dir()) if spec.source == DEFAULT_DRAFT else spec.source
    ckpt = open_checkpoint(source, spec.revision)  # every file checked by the checkpoint readers first
    standalone = ckpt.folder is not None and ckpt.layout.key.startswith("deepspec")
    if not standalone:
        if spec.target is not None:
            raise UsageError(f"{option('target')} checks a standalone draft folder; {spec.source} is a whole "
                             "checkpoint", f"extract the draft first, or drop {option('target')}")
        report = inspect_report(ckpt)
        if ckpt.bytes_transferred:
            report["transferred_bytes"] = ckpt.bytes_transferred
        if ckpt.layout.key.startswith("deepspec"):  # a remote standalone draft: read by its headers only
            report["findings"].append({"level": "warning", "check": "format", "message": (
                "read by its headers only: which trainer's format this is, and its conventions, need the files "
                "(`dsparkctl download` it, then inspect the folder)")})
        return report
    folder = ckpt.folder
    fmt = formats.detect(folder)  # files that disagree on their format are refused here, in one line
    try:
        draft = formats.read(folder)
    except CheckpointError as exc:
        if spec.target is not None or fmt.key != "deepspec":
            raise
        report = inspect_report(ckpt)  # a DeepSpec-named folder whose config is not a draft's (a layout fixture)
        report["findings"].append({"level": "warning", "check": "draft", "message": f"not loadable as a draft: {exc}"})
        return report
    described = describe(draft, folder)
    if draft.format == "deepspec":  # the layout report stands, with the format's description beside it
        report = {**inspect_report(ckpt), "draft_format": described}
    else:  # the layouts table knows only DeepSpec's names: the registry speaks for the other formats
        report = {"source": str(folder), "draft_format": described, "findings": []}
    report["findings"] += [{"level": "warning", "check": "runtime", "message": w} for w in described["warnings"]]
    if spec.target is not None:
        report["findings"] += _pair(spec, draft, folder, log)
    return report


def _pair(spec: InspectSpec, draft: formats.CanonicalDraft, folder: Path,
          log: Callable[[str], None]) -> list[dict[str, str]]:
    tfolder = embedded_target_dir(log=log) if is_embedded(spec.target) else resolve_folder(spec.target, spec.revision)
    name = "embedded" if is_embedded(spec.target) else str(spec.target)
    try:
        tcfg = AutoConfig.from_pretrained(tfolder)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read target {name}'s config: {str(exc).splitlines()[0]}",
                              "pass a transformers model folder or hub id") from None
    found = pair_findings(draft, folder, tcfg, name)
    if spec.probe and not any(f["level"] == "error" for f in found):
        found.append(_probe(spec, folder, draft.facts.layer_ids_key if draft.facts else "target_layer_ids", log))
    return found


def _probe(spec: InspectSpec, folder: Path, field: str, log: Callable[[str], None]) -> dict[str, Any]:
    texts = load_prompts(spec.dataset, None, spec.probe)
    sess = open_target(spec.target, revision=spec.revision, log=log, cpu_kernels="stock", draft_weights="fp32")
    draft, _, _ = sess.load_draft(str(folder), spec.revision)
    lt = sess.target
    prompts = encode_prompts(lt.tokenizer, texts)
    conts, _ = cached_continuations(lt.model, prompts, SamplingParams(0.0), PROBE_TOKENS, sess.stop_ids, log=log)
    seqs = [p + c for p, c in zip(prompts, conts)]
    result = probe(draft, lt.model, seqs, [len(p) for p in prompts], lt.model.config.get_text_config().num_hidden_layers)
    rows = "; ".join(f"{r['reading']}: c1 {_pct(r['c1'])} (backbone alone {_pct(r['c1_backbone'])})"
                     for r in result["readings"])
    if result["declared_fits"]:
        message = f"the file's conventions fit ({result['declared']}); measured on {len(seqs)} prompts: {rows}"
    else:
        message = (f"{folder}/config.json's conventions do not fit the weights: {result['best']} does, c1 "
                   f"+{100 * result['gain_c1']:.1f} points (t {result['t']:.1f}) over the file's reading "
                   f"(measured on {len(seqs)} prompts: {rows}); fix: {_fix(result, folder, field)}")
    return {"level": "ok" if result["declared_fits"] else "error", "check": "conventions", "message": message,
            "probe": result}


def _fix(result: dict[str, Any], folder: Path, field: str) -> str:
    best = next(r for r in result["readings"] if r["reading"] == result["best"])
    declared = result["readings"][0]
    fixes = []
    if best["sample_from_anchor"] != declared["sample_from_anchor"]:
        fixes.append(f"the slot convention: sample_from_anchor {str(best['sample_from_anchor']).lower()}")
    if best["layer_shift"]:
        fixes.append(f"the target layer ids: add {best['layer_shift']:+d} to each of {field}")
    return f"set {' and '.join(fixes)} in {folder}/config.json (then inspect --probe again)"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"
