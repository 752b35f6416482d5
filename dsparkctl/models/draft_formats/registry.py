"""The draft formats, as one table, and the three things done with them: recognise, read, write.

`detect` decides a folder's format from its files (config.json's structure, the tensor names in
the safetensors headers, files only one format writes), never from `architectures`, and refuses
a folder whose files disagree. `read` gives the canonical draft (base.py); `write` puts one in a
format, refusing up front anything the format cannot hold unless the user drops it by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from dsparkctl.checkpoint.source import SINGLE
from dsparkctl.errors import CheckpointError, UsageError
from dsparkctl.files.atomic import atomic_dir
from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.models.draft_formats import vocab as vmap
from dsparkctl.models.draft_formats.base import BORROWED, TOOL_KEY, CanonicalDraft, DraftFormat
from dsparkctl.models.draft_formats.deepspec import DEEPSPEC
from dsparkctl.models.draft_formats.files import read_config_file, read_tensors, tensor_names
from dsparkctl.models.draft_formats.modelopt import MODELOPT
from dsparkctl.models.draft_formats.specforge import SPECFORGE
from dsparkctl.models.draft_formats.speculators import SPECULATORS
from dsparkctl.strict_json import finite

QUANTIZED = {torch.float8_e4m3fn: "FP8 (e4m3, per-tensor scale)", torch.uint8: "NVFP4 (e2m1, scales per 16)"}
FORMATS: tuple[DraftFormat, ...] = (DEEPSPEC, SPECULATORS, SPECFORGE, MODELOPT)
BY_KEY = {f.key: f for f in FORMATS}
DROPPABLE = ("vocab-map", "confidence-head", "quantization")  # what `convert --drop` may give up, by name


def format_named(key: str) -> DraftFormat:
    key = key.strip().lower()  # SpecForge, ModelOpt: the names as their projects write them
    if key not in BY_KEY:
        raise UsageError(f"unknown draft format {key!r}", f"use one of {', '.join(BY_KEY)}")
    return BY_KEY[key]


# --------------------------------------------------------------------------------------- detect
def _claim_names(fmts: list[DraftFormat]) -> str:
    return " and ".join(f"{f.title} ({f.key})" for f in fmts)


def detect(folder: Path, config: dict[str, Any] | None = None,
           names: set[str] | None = None) -> DraftFormat:
    """The folder's format, when its config, its tensors and its files agree on one."""
    config = read_config_file(folder) if config is None else config
    names = set(tensor_names(folder)) if names is None else names
    by_config = [f for f in FORMATS if f.claims_config(config)]
    by_tensors = [f for f in FORMATS if f.claims_tensors(names)]
    by_files = [f for f in FORMATS for own in f.own_files if (folder / own).exists()]
    if not by_tensors:  # not a standalone draft at all (a whole checkpoint, DeepSeek's mtp.* layout, ...)
        raise CheckpointError(f"{folder}: no draft tensors of a known layout (fc/hidden_norm with the heads of "
                              f"{', '.join(BY_KEY)})", "point at a DSpark/DFlash draft folder")
    if len(by_config) > 1:
        raise CheckpointError(f"{folder}/config.json carries the keys of two formats: {_claim_names(by_config)}",
                              "keep one format's keys (convert the draft with dsparkctl convert)")
    if not by_config:
        raise CheckpointError(f"{folder}/config.json is not a draft config of any known format (its tensors look "
                              f"like {_claim_names(by_tensors)})",
                              "restore the config.json saved with these weights")
    fmt = by_config[0]
    if fmt not in by_tensors:
        seen = f"the tensors of {_claim_names(by_tensors)}" if by_tensors else "tensors of no known draft format"
        raise CheckpointError(f"{folder}/config.json says {fmt.title} ({fmt.key}) but the safetensors hold {seen}",
                              "put the config.json saved with these weights back (or convert with dsparkctl convert)")
    others = [f for f in by_files if f is not fmt]
    if others:
        own = [o for f in others for o in f.own_files if (folder / o).exists()]
        raise CheckpointError(f"{folder} mixes two formats' files: {fmt.key} weights and config with {own[0]} "
                              f"({others[0].title})", "keep each format in its own folder")
    for extra in sorted(folder.glob("*.gguf")):
        raise CheckpointError(f"{folder} mixes two formats' files: a {fmt.key} draft and {extra.name} (GGUF)",
                              "keep each format in its own folder")
    return fmt


# ----------------------------------------------------------------------------------------- read
def read(folder: str | os.PathLike) -> CanonicalDraft:
    """A draft folder of any known format, as the canonical draft (every field and tensor checked)."""
    folder = Path(folder)
    config = read_config_file(folder)
    names = tensor_names(folder)
    fmt = detect(folder, config, set(names))
    where = f"{folder}/config.json"
    flat, facts = fmt.read_config(config, where)  # type: ignore[misc]
    try:
        cfg = DraftConfig.from_dict(flat, where)
    except CheckpointError as exc:  # say it in the file's own terms where they differ from the canonical ones
        if fmt.layer_offset and "target" in exc.message and "layer" in exc.message:
            raise CheckpointError(f"{exc.message} (canonical ids; the file's {facts.layer_ids_key} are "
                                  f"{list(facts.layer_ids)}, canonical + {fmt.layer_offset})", exc.hint) from None
        if "missing" in exc.message and facts.layer_ids_key != "target_layer_ids":
            raise CheckpointError(exc.message.replace("target_layer_ids", facts.layer_ids_key),
                                  "restore the config.json saved with these weights") from None
        raise
    raw = read_tensors(folder, checked=True)  # tensor_names above checked the headers and the index
    tensors: dict[str, Tensor] = {}
    for name, t in raw.items():
        tensors[fmt.to_canonical_name(name)] = t
    tool = config.get(TOOL_KEY) if isinstance(config.get(TOOL_KEY), dict) else {}
    conv = tool.get("conversion") if isinstance(tool.get("conversion"), dict) else {}
    added = tuple(n for n in conv.get("added", []) if n in BORROWED)
    changes = tuple(c for c in conv.get("changes", []) if isinstance(c, str))
    tensors, cfg = _canonical_vocab(fmt, tensors, cfg, str(folder))
    named = tool.get("target")  # what dsparkctl recorded: a conversion's {name_or_path, ...}, training's name
    if facts.target is None and isinstance(named, (dict, str)):
        facts = dataclasses.replace(facts, target=named if isinstance(named, dict) else {"name_or_path": named})
    if fmt.read_tensors is not None:
        tensors = fmt.read_tensors(tensors, cfg, facts, str(folder))
    cfg = check_structure(cfg, tensors, fmt, facts, str(folder))
    packed = {t.dtype for n, t in raw.items() if n.endswith(".weight") and t.dtype in QUANTIZED}
    declared = facts.quantization
    facts = dataclasses.replace(facts, quantization={  # what the tensors hold; the config's word beside it
        "scheme": " + ".join(sorted(QUANTIZED[d] for d in packed)),
        "weights": sum(1 for n, t in raw.items() if n.endswith(".weight") and t.dtype in QUANTIZED),
        "declared": declared} if packed else None)
    return CanonicalDraft(cfg, tensors, fmt.key, facts, tuple(n for n in added if n in tensors), changes)


def check_structure(cfg: DraftConfig, tensors: dict[str, Tensor], fmt: DraftFormat, facts: Any,
                    where: str) -> DraftConfig:
    """Every tensor the config implies is there with its shape, nothing else is, and every weight is
    finite; the config as the weights have it (a backbone without q/k norms)."""
    from dsparkctl.models.draft import DSparkDraft

    fc = tensors.get("fc.weight")
    if fc is not None and (fc.dim() != 2 or fc.shape[1] != len(cfg.target_layer_ids) * cfg.hidden_size):
        raise CheckpointError(f"{where}: fc.weight has shape {list(fc.shape)}, expected [{cfg.hidden_size}, "
                              f"{len(cfg.target_layer_ids) * cfg.hidden_size}] for {len(cfg.target_layer_ids)} tapped "
                              f"layers ({facts.layer_ids_key} {list(facts.layer_ids)})",
                              f"fix {facts.layer_ids_key} in config.json to the layers these weights were trained on")
    if cfg.markov_rank == 0 and any(k.startswith("markov_head.") for k in tensors):
        raise CheckpointError(f"{where}: the config says no Markov head (markov_rank 0) but the file has its tensors",
                              "fix markov_rank in config.json (or the format's projector/DSpark fields)")
    if "layers.0.self_attn.q_norm.weight" not in tensors and any(k.startswith("layers.0.") for k in tensors):
        cfg = cfg.replace(qk_norm=False)
    with torch.device("meta"):  # shapes only: nothing is allocated
        expected = {k: tuple(v.shape) for k, v in DSparkDraft(cfg).state_dict().items()}
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: tensor {fmt.to_file_name(unexpected[0])} does not belong to the draft its "
                              f"config describes ({len(unexpected)} such)",
                              "use the config.json saved with these weights (markov_head_type, confidence head?)")
    for name, shape in expected.items():
        if name not in tensors:
            if name in BORROWED:
                continue
            raise CheckpointError(f"{where}: missing tensor {fmt.to_file_name(name)}", "the checkpoint is incomplete")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{where}: tensor {fmt.to_file_name(name)} has shape {tuple(tensors[name].shape)}, "
                                  f"expected {tuple(shape)} from config.json", "use the config.json saved with these weights")
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{where}: tensor {fmt.to_file_name(name)} holds NaN or infinite values",
                                  "the weights are damaged: re-download or re-export the draft")
    return cfg


def _canonical_vocab(fmt: DraftFormat, tensors: dict[str, Tensor], cfg: DraftConfig,
                     where: str) -> tuple[dict[str, Tensor], DraftConfig]:
    """Whatever map the file uses -> `draft_vocab_ids` (or none for a full vocabulary)."""
    V = cfg.vocab_size
    if "d2t" in tensors or "t2d" in tensors:
        if "d2t" not in tensors:
            raise CheckpointError(f"{where}: t2d without d2t", "the draft-to-target offsets d2t are missing")
        ids = vmap.ids_from_d2t(tensors.pop("d2t"), tensors.pop("t2d", None), V, where)
        if cfg.draft_vocab_size and cfg.draft_vocab_size != ids.numel():
            raise CheckpointError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} but d2t maps {ids.numel()} draft ids",
                                  "make draft_vocab_size the length of d2t (re-export the draft)")
        if vmap.is_identity(ids, V):
            return tensors, cfg.replace(draft_vocab_size=0)
        tensors["draft_vocab_ids"] = ids
        cfg = cfg.replace(draft_vocab_size=ids.numel())
    if "draft_vocab_ids" in tensors:
        vmap.check_index(tensors["draft_vocab_ids"], V, cfg.draft_vocab_size or None, where)
        if not cfg.draft_vocab_size:
            cfg = cfg.replace(draft_vocab_size=tensors["draft_vocab_ids"].numel())
    elif cfg.draft_vocab_size and cfg.draft_vocab_size != V:
        raise CheckpointError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} but no vocabulary map "
                              "(draft_vocab_ids, or d2t and t2d)", "the map was lost; re-export the draft")
    else:
        cfg = cfg.replace(draft_vocab_size=0)
    return tensors, cfg


# ---------------------------------------------------------------------------------------- write
def check_drops(drop: tuple[str, ...]) -> None:
    """`--drop` values by their spelling (whether each is needed waits for the draft: `plan`)."""
    bad = [d for d in drop if d not in DROPPABLE]
    if bad:
        raise UsageError(f"--drop {bad[0]!r} is not something a conversion can drop", f"use {' or '.join(DROPPABLE)}")


def plan(draft: CanonicalDraft, fmt: DraftFormat, drop: tuple[str, ...] = ()) -> list[str]:
    """What writing `draft` as `fmt` changes, in words ([] = nothing); UsageError, before any work,
    for a loss the user did not drop by name, or a drop that is not needed."""
    check_drops(drop)
    cfg, changes, needed = draft.config, [], set()
    _cannot_hold(cfg, fmt)  # what no drop can fix is said first
    if draft.reduced and fmt.vocab == "full":
        needed.add("vocab-map")
        if "vocab-map" in drop:
            changes.append(f"vocabulary map dropped: the {cfg.draft_vocab_size}-token draft head became the "
                           f"target's full {cfg.vocab_size}-token head (W2 zero outside the subset); acceptance moves")
    if cfg.enable_confidence_head and not cfg.confidence_head_with_markov and not fmt.holds_hidden_only_confidence:
        needed.add("confidence-head")
        if "confidence-head" in drop:
            changes.append("confidence head dropped: the format's head always reads the Markov embedding and this "
                           "draft's reads the hidden state only")
    if draft.facts is not None and draft.facts.quantization:
        needed.add("quantization")
        if "quantization" in drop:
            changes.append(f"quantization dropped: {draft.facts.quantization['weights']} "
                           f"{draft.facts.quantization['scheme']} weights were dequantized to the config's dtype")
    lost = sorted(needed - set(drop))
    if lost:
        why = {"vocab-map": f"{fmt.title} holds only full-vocabulary drafts and this draft's head covers "
                            f"{cfg.draft_vocab_size} of {cfg.vocab_size} tokens",
               "confidence-head": f"{fmt.title}'s confidence head cannot take this draft's inputs "
                                  f"({'with' if cfg.confidence_head_with_markov else 'without'} the Markov embedding)",
               "quantization": f"{fmt.title} would be written dequantized (dsparkctl writes no quantized weights) "
                               "and the values change"}
        raise UsageError(f"converting to {fmt.key} would lose something: {why[lost[0]]}",
                         f"add --drop {lost[0]} to convert anyway (then measure it with eval-acceptance), or pick "
                         f"a format that holds it")
    unused = set(drop) - needed
    if unused:
        raise UsageError(f"--drop {sorted(unused)[0]}: nothing to drop (the draft fits {fmt.key} as it is)",
                         "leave it out")
    return changes


def _cannot_hold(cfg: DraftConfig, fmt: DraftFormat) -> None:
    if not cfg.sample_from_anchor and not fmt.holds_anchor_free_slots:
        raise UsageError(f"{fmt.title} cannot say that slot 0 predicts nothing (sample_from_anchor false): a "
                         "loader would read every slot one position early and accept almost nothing",
                         "convert to deepspec or speculators, which state the slot convention")
    if fmt.needs_markov and cfg.markov_rank == 0:
        raise UsageError(f"{fmt.title} holds DSpark drafts (with a Markov head) and this is a DFlash draft",
                         "convert to deepspec or speculators, which hold DFlash drafts too")
    if cfg.markov_rank and cfg.markov_head_type not in fmt.holds_head_types:
        raise UsageError(f"{fmt.title} has no {cfg.markov_head_type} Markov head",
                         f"convert to a format that holds it ({fmt.key} holds {', '.join(fmt.holds_head_types)})")


def apply_drops(draft: CanonicalDraft, fmt: DraftFormat, drop: tuple[str, ...]) -> CanonicalDraft:
    """The canonical draft after the drops `plan` accepted."""
    cfg, tensors = draft.config, dict(draft.tensors)
    if "vocab-map" in drop and draft.reduced and fmt.vocab == "full":
        tensors = vmap.expand(tensors, cfg.vocab_size)
        cfg = cfg.replace(draft_vocab_size=0)
    if "confidence-head" in drop:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("confidence_head.")}
        cfg = cfg.replace(enable_confidence_head=False, confidence_head_with_markov=False)
    facts = draft.facts
    if "quantization" in drop and facts is not None:  # the tensors were dequantized when they were read
        facts = dataclasses.replace(facts, quantization=None)
    return CanonicalDraft(cfg, tensors, draft.format, facts, draft.added, draft.changes)


def with_borrowed(draft: CanonicalDraft, fmt: DraftFormat, embed: Tensor | None, head: Tensor | None) -> CanonicalDraft:
    """The draft with the target's embedding / head rows the format must carry (`fmt.needs`)."""
    tensors, added = dict(draft.tensors), list(draft.added)
    dtype = next((t.dtype for k, t in tensors.items() if t.is_floating_point() and k not in BORROWED), torch.bfloat16)
    for name in fmt.needs(draft.config):
        if name in tensors:
            continue
        source = embed if name == "embed_tokens.weight" else head
        if source is None:
            raise UsageError(f"{fmt.title} files carry {name} and this draft borrows it from its target",
                             "pass --target (the model the draft was trained for) so it can be copied in")
        if name == "lm_head.weight" and draft.reduced:
            source = source[tensors["draft_vocab_ids"]]
        tensors[name] = source.detach().to("cpu", dtype).contiguous()
        added.append(name)
    return CanonicalDraft(draft.config, tensors, draft.format, draft.facts, tuple(added), draft.changes)


def file_tensors(draft: CanonicalDraft, fmt: DraftFormat) -> dict[str, Tensor]:
    """The canonical tensors as `fmt` stores them: its vocabulary map and its names."""
    keep = set(fmt.needs(draft.config))
    tensors = {k: v for k, v in draft.tensors.items() if k not in draft.added or k in keep}  # copies only where needed
    V = draft.config.vocab_size
    if fmt.vocab == "d2t" and "draft_vocab_ids" in tensors:  # a full vocabulary has no map at all
        tensors["d2t"], tensors["t2d"] = vmap.d2t_from_ids(tensors.pop("draft_vocab_ids"), V)
    if fmt.write_tensors is not None:
        tensors = fmt.write_tensors(tensors, draft.config)
    return {fmt.to_file_name(k): v.contiguous() for k, v in tensors.items()}


def write(draft: CanonicalDraft, fmt: DraftFormat, out: Path, provenance: dict[str, Any] | None = None,
          check: Callable[[Path], None] | None = None) -> Path:
    """`draft` (already planned, dropped and completed) into the new folder `out`, atomically;
    `check(folder)` runs on the finished files before they take the name `out` (an error there
    leaves nothing)."""
    from safetensors.torch import save_file

    tensors = file_tensors(draft, fmt)
    config = fmt.write_config(draft)  # type: ignore[misc]
    floats = [t.dtype for k, t in draft.tensors.items() if t.is_floating_point() and k not in draft.added]
    if floats:  # the config's dtype says what the file holds, not what the source's config said
        name = str(max(set(floats), key=floats.count)).removeprefix("torch.")
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = name
    mine = config.get(TOOL_KEY) if isinstance(config.get(TOOL_KEY), dict) else {}
    if draft.facts is not None and draft.facts.target and not fmt.names_target:
        mine["target"] = draft.facts.target  # kept for the way back to a format that names it
    kept = [n for n in draft.added if n in fmt.needs(draft.config)]
    config[TOOL_KEY] = {**mine, **(provenance or {}), "conversion": {
        "from": draft.format, "added": kept, "changes": list(draft.changes)}}
    with atomic_dir(out, on_exists="refuse") as tmp:
        save_file(tensors, str(tmp / SINGLE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(finite(config), indent=2, allow_nan=False) + "\n")
        if check is not None:
            check(tmp)
    return out
