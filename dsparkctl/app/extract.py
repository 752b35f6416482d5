"""`extract`: check the settings and OUT (new, never inside the input model), fetch a hub repo's
draft shards, cut the draft out atomically (checkpoint/extract.py) and report what was written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs, local_inputs
from dsparkctl.checkpoint import hub
from dsparkctl.checkpoint.extract import extract
from dsparkctl.checkpoint.source import open_local
from dsparkctl.errors import CheckpointError, UsageError, option
from dsparkctl.models import draft_formats as formats


MIN_SHARD_SIZE = 100_000  # smaller shards only multiply files: a draft of 1-byte shards is one file per tensor


@dataclass(frozen=True)
class ExtractSpec:
    """Everything `extract` runs (`run_extract` checks it)."""
    source: str  # a local checkpoint folder or a hub repo id
    out_dir: Path  # the new folder for the draft checkpoint
    revision: str | None = None  # hub repos only
    dequantize: str | None = None  # "bf16": convert FP8/FP4 weights and drop their scales
    max_shard_size: int = 5_000_000_000  # bytes per output shard, at most
    with_head: bool = False  # also the target's embed/head the draft borrows
    verify: bool = False  # re-read the output and check every tensor


def _not_a_standalone_draft(source: str) -> None:
    """A draft folder of a trainer's format is already standalone: `convert` moves it between formats."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return
    try:
        fmt = formats.detect(folder)
    except CheckpointError:
        return  # not a standalone draft: a whole checkpoint, which is what extract is for
    if fmt.key != "deepspec":
        raise UsageError(f"{source} is already a standalone draft ({fmt.title}); extract cuts drafts out of whole "
                         "checkpoints", "use `dsparkctl convert` to write it in another format")


def run_extract(spec: ExtractSpec, *, on_bytes: Callable[[int, int], None] | None = None,
                note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`extract` as one call: check the settings and OUT (new, and never inside the input model),
    fetch a hub repo's draft shards (`hub.download`), write the draft atomically (`extract`) and
    return {"out", "layout", "tensors", "bytes", "shards", "source_shards_sha256", "verified"}.
    `on_bytes(n, total)`: n more of the total source bytes read (from worker threads); `note`
    gets the partial folders of earlier killed runs that were removed."""

    if spec.dequantize not in (None, "bf16"):
        raise UsageError(f"{option('dequantize')} {spec.dequantize!r} is not supported",
                         hint=f"use {option('dequantize')} bf16")
    if spec.max_shard_size < MIN_SHARD_SIZE:
        raise UsageError(f"{option('max_shard_size')} {spec.max_shard_size} bytes is below the minimum of "
                         f"{MIN_SHARD_SIZE:,} bytes (100KB)", hint=f"use e.g. {option('max_shard_size')} 5GB")
    out = spec.out_dir
    if out.exists():
        raise UsageError(f"{out} already exists", hint="choose a new output folder or delete the old one")
    inputs = local_inputs(spec.source)
    inputs += [p.parent for p in inputs if p.is_file()]  # a checkpoint file: its folder is the model
    check_outputs([Output(out, option("out_dir"), "folder")], inputs)  # never inside the input model
    _not_a_standalone_draft(spec.source)
    if hub.looks_like_repo(spec.source):
        ckpt = open_local(hub.download(spec.source, spec.revision, None, spec.with_head).folder)
    else:
        ckpt = hub.open_checkpoint(spec.source, spec.revision)
    files = {ckpt.weight_map[n] for n in ckpt.draft_names(spec.with_head)}
    total = sum(ckpt.headers[f].file_size for f in files if f in ckpt.headers)
    res = extract(ckpt, out, dequantize=bool(spec.dequantize), with_head=spec.with_head,
                  max_shard_size=spec.max_shard_size, verify=spec.verify,
                  on_bytes=(lambda n: on_bytes(n, total)) if on_bytes else None, log=note)
    return {"out": str(res.out), "layout": ckpt.layout.key, "tensors": res.tensors, "bytes": res.bytes_written,
            "shards": res.shards, "source_shards_sha256": res.source_shards, "verified": res.verified}
