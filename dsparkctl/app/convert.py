"""`convert`: a draft of any known format into another (models/draft_formats): read, plan what the
target format cannot hold (refused unless dropped by name), copy in what it must carry from the
target, write atomically, read the result back and check it against what was written."""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoConfig

from dsparkctl.app.preflight import Output, check_outputs, local_inputs
from dsparkctl.checkpoint.hub import looks_like_repo
from dsparkctl.errors import InputError, ModelMismatchError, UsageError, option
from dsparkctl.models import draft_formats as formats
from dsparkctl.models.embedded import embedded_target_dir
from dsparkctl.models.draft_formats.describe import pair_findings
from dsparkctl.models.loading import (default_draft_dir, is_default_draft, is_embedded, load_target, resolve_device,
                                      resolve_folder)
from dsparkctl.provenance import provenance


SIDECARS = ("calibration.json", "calibration.sglang-sts.json")  # dsparkctl's files beside a draft, kept with it


@dataclass(frozen=True)
class ConvertSpec:
    """Everything `convert` runs (`run_convert` checks it)."""
    source: str  # a draft folder of any known format, or "default" (the shipped draft)
    out_dir: Path  # the new folder
    to: str  # the format to write (draft_formats.BY_KEY)
    drop: tuple[str, ...] = ()  # what the user agrees to lose (draft_formats.DROPPABLE)
    target: str | None = None  # the draft's target, when the format must carry its embedding/head rows
    revision: str | None = None


def _source_folder(source: str) -> Path:
    folder = default_draft_dir() if is_default_draft(source) else Path(source).expanduser()
    if folder is None or not folder.is_dir():
        raise InputError(f"{source} is not a draft folder", "pass a folder holding config.json and model.safetensors")
    return folder


def _target_rows(spec: ConvertSpec, cfg: Any, log: Callable[[str], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output head [V, H] (what a format may have to carry)."""
    loaded = load_target(spec.target, resolve_device("cpu"), torch.float32, spec.revision, log=log)
    embed = loaded.model.get_input_embeddings().weight.detach()
    head_mod = loaded.model.get_output_embeddings()
    head = (head_mod.weight if head_mod is not None else embed).detach()
    if tuple(head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ModelMismatchError(f"target {loaded.name} has a [{head.shape[0]}, {head.shape[1]}] head; the draft "
                                 f"wants [{cfg.vocab_size}, {cfg.hidden_size}] (vocab_size, hidden_size)",
                                 f"pass the target the draft was trained for as {option('target')}")
    return embed, head


def run_convert(spec: ConvertSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    """`convert` as one call; returns what was written and what changed."""
    fmt = formats.format_named(spec.to)
    formats.check_drops(spec.drop)
    folder = _source_folder(spec.source)
    inputs = local_inputs(folder, target=spec.target if spec.target is not None else False)
    check_outputs([Output(spec.out_dir, option("out_dir"), "folder")], inputs)  # empty, the input, inside it, ...
    if os.path.lexists(spec.out_dir):
        what = "is a symbolic link" if spec.out_dir.is_symlink() else "already exists"
        raise UsageError(f"{option('out_dir')} {spec.out_dir} {what}",
                         "choose a new folder (a conversion never writes over a folder, its input least of all)")
    parent = spec.out_dir.expanduser().resolve().parent
    if (parent / "config.json").is_file() and any(parent.glob("*.safetensors")):
        raise UsageError(f"{option('out_dir')} {spec.out_dir} is inside the model folder {parent}",
                         "write the converted draft to a folder of its own")
    draft = formats.read(folder)
    changes = formats.plan(draft, fmt, spec.drop)
    named = None  # named, it must be the draft's target, whether or not rows are copied from it
    if spec.target is not None:
        named = _checked_target(spec, draft, folder, log)
    draft = formats.apply_drops(draft, fmt, spec.drop)
    missing = [n for n in fmt.needs(draft.config) if n not in draft.tensors]
    embed = head = None
    if missing:
        if spec.target is None:
            raise UsageError(f"{fmt.title} files carry {missing[0]} and this draft borrows it from its target",
                             f"pass {option('target')} (the model the draft was trained for; embedded for the "
                             "shipped draft) so it can be copied in")
        embed, head = _target_rows(spec, draft.config, log)
    had = set(draft.added)
    draft = formats.with_borrowed(draft, fmt, embed, head)
    if named is not None and draft.facts is not None:  # the target the user named is the one to record
        draft = dataclasses.replace(draft, facts=dataclasses.replace(draft.facts, target=named))
    draft = dataclasses.replace(draft, changes=tuple(draft.changes) + tuple(changes))
    read_back: list[formats.CanonicalDraft] = []
    copied: list[str] = []

    def check(tmp: Path) -> None:  # what a reader of the new folder gets: the draft that was written
        read_back.append(formats.read(tmp))
        if not _same_draft(draft, read_back[0]):
            raise InputError(f"{spec.out_dir}: reading the conversion back does not give the draft that was "
                             "written (a bug); nothing was written", "report this with the source's config.json")
        if not changes:  # the same weights: the calibration fitted for them still applies (it names their fingerprint)
            for name in SIDECARS:
                f = folder / name
                if f.is_file() and not f.is_symlink():
                    shutil.copyfile(f, tmp / name)
                    copied.append(name)

    formats.write(draft, fmt, spec.out_dir, provenance(source=str(spec.source), command="convert"), check=check)
    return {"source": str(folder), "from": draft.format, "to": fmt.key, "out": str(spec.out_dir),
            "tensors": len(read_back[0].tensors), "added_from_target": [n for n in draft.added if n not in had], "changes": list(changes),
            "warnings": list(draft.facts.warnings if draft.facts else ()) + fmt.warnings(draft.config)
            + _unnamed(fmt, draft),
            "read_back_identical": True, "copied": copied}


def _checked_target(spec: ConvertSpec, draft: formats.CanonicalDraft, folder: Path,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """The draft against `--target`'s config (vocabulary, width, depth), before anything is written;
    returns what a format that names its target records: a folder (the embedded target's converted
    one) by its absolute path, a hub id as given, with the architectures its config lists."""
    local = is_embedded(spec.target) or Path(str(spec.target)).expanduser().is_dir()
    tfolder = embedded_target_dir(log=log) if is_embedded(spec.target) else resolve_folder(spec.target, spec.revision)
    try:
        tcfg = AutoConfig.from_pretrained(tfolder)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"cannot read target {spec.target}'s config: {str(exc).splitlines()[0]}",
                         f"pass a transformers model folder or hub id as {option('target')}") from None
    bad = [f for f in pair_findings(draft, folder, tcfg, str(spec.target)) if f["level"] == "error"]
    if bad:
        raise ModelMismatchError(bad[0]["message"], f"pass the target the draft was trained for as {option('target')}")
    return {"name_or_path": str(tfolder.resolve()) if local else spec.target,
            "architectures": [a for a in (tcfg.architectures or []) if isinstance(a, str)]}


def _unnamed(fmt: formats.DraftFormat, draft: formats.CanonicalDraft) -> list[str]:
    """A format whose engines load the target the file names, written without a loadable one."""
    target = (draft.facts.target if draft.facts else None) or {}
    name = target.get("name_or_path")
    if not fmt.names_target or (isinstance(name, str) and (Path(name).is_dir() or looks_like_repo(name))):
        return []
    return [f"the file names its target as {name!r}, which vLLM's `vllm serve DRAFT` cannot load; pass --target "
            "(a folder or hub id) to record one it can"]


def _same_draft(a: formats.CanonicalDraft, b: formats.CanonicalDraft) -> bool:
    """The same config fields and the same own tensors, bit for bit and dtype for dtype."""
    own_a, own_b = a.own_tensors, b.own_tensors
    return a.config == b.config and own_a.keys() == own_b.keys() and all(
        own_a[k].dtype == own_b[k].dtype and own_a[k].shape == own_b[k].shape and torch.equal(_bytes(own_a[k]), _bytes(own_b[k]))
        for k in own_a)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
