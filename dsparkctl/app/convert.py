"""`convert`: a draft of any known format into another (models/draft_formats): read, plan what the
target format cannot hold (refused unless dropped by name), copy in what it must carry from the
target, write atomically, read the result back and check it against what was written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.app.preflight import Output, check_outputs, local_inputs
from dsparkctl.errors import InputError, ModelMismatchError, UsageError, option
from dsparkctl.models import draft_formats as formats
from dsparkctl.models.loading import default_draft_dir, is_default_draft, load_target, resolve_device
from dsparkctl.provenance import provenance


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
    folder = _source_folder(spec.source)
    inputs = local_inputs(folder, target=spec.target if spec.target is not None else False)
    if spec.out_dir.exists():
        raise UsageError(f"{option('out_dir')} {spec.out_dir} already exists",
                         "choose a new folder (a conversion never writes over a folder, its input least of all)")
    check_outputs([Output(spec.out_dir, option("out_dir"), "folder")], inputs)
    draft = formats.read(folder)
    changes = formats.plan(draft, fmt, spec.drop)
    draft = formats.apply_drops(draft, fmt, spec.drop)
    missing = [n for n in fmt.needs(draft.config) if n not in draft.tensors]
    embed = head = None
    if missing:
        if spec.target is None:
            raise UsageError(f"{fmt.title} files carry {missing[0]} and this draft borrows it from its target",
                             f"pass {option('target')} (the model the draft was trained for; embedded for the "
                             "shipped draft) so it can be copied in")
        embed, head = _target_rows(spec, draft.config, log)
    draft = formats.with_borrowed(draft, fmt, embed, head)
    draft = formats.CanonicalDraft(draft.config, draft.tensors, draft.format, draft.facts, draft.added,
                                   tuple(draft.changes) + tuple(changes))
    read_back: list[formats.CanonicalDraft] = []

    def check(tmp: Path) -> None:  # what a reader of the new folder gets: the draft that was written
        read_back.append(formats.read(tmp))
        if not _same_draft(draft, read_back[0]):
            raise InputError(f"{spec.out_dir}: reading the conversion back does not give the draft that was "
                             "written (a bug); nothing was written", "report this with the source's config.json")

    formats.write(draft, fmt, spec.out_dir, provenance(source=str(spec.source), command="convert"), check=check)
    return {"source": str(folder), "from": draft.format, "to": fmt.key, "out": str(spec.out_dir),
            "tensors": len(read_back[0].tensors), "added_from_target": list(draft.added), "changes": list(changes),
            "warnings": list(draft.facts.warnings if draft.facts else ()) + fmt.warnings(draft.config),
            "read_back_identical": True}


def _same_draft(a: formats.CanonicalDraft, b: formats.CanonicalDraft) -> bool:
    """The same config fields and the same own tensors, bit for bit and dtype for dtype."""
    own_a, own_b = a.own_tensors, b.own_tensors
    return a.config == b.config and own_a.keys() == own_b.keys() and all(
        own_a[k].dtype == own_b[k].dtype and own_a[k].shape == own_b[k].shape and torch.equal(own_a[k], own_b[k])
        for k in own_a)
