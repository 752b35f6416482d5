"""What `inspect` reports: layout, components, which shards hold the draft, config fields, findings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsparkctl.checkpoint.components import component_table
from dsparkctl.checkpoint.layouts import dspark_fields, fp8_block, text_config
from dsparkctl.checkpoint.source import Checkpoint, check_scales, expected_scale_shape, quant_kind, scale_name


@dataclass(frozen=True)
class Finding:
    level: str  # "ok" | "warning" | "error"
    check: str  # short id, e.g. "markov_rank"
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"level": self.level, "check": self.check, "message": self.message}


def stage_count(ckpt: Checkpoint) -> int | None:
    stages = {ckpt.layout.stage_of(n) for n in ckpt.draft_names()} - {None}
    return len(stages) if stages else None


def draft_shards(ckpt: Checkpoint, names: list[str]) -> list[str]:
    return sorted({ckpt.weight_map[n] for n in names})


def consistency(ckpt: Checkpoint) -> list[Finding]:
    """Every check from the issue; each yields one finding (ok, warning or error)."""
    lay, cfg = ckpt.layout, text_config(ckpt.config)
    out: list[Finding] = []

    def add(ok: bool, check: str, good: str, bad: str, level: str = "error") -> None:
        out.append(Finding("ok" if ok else level, check, good if ok else bad))

    def have(name: str | None) -> bool:
        return name is not None and name in ckpt.weight_map

    stages = stage_count(ckpt)
    declared = cfg.get("num_nextn_predict_layers")
    if stages is not None:
        add(declared == stages, "stages", f"{stages} stages in the weight map, config agrees",
            f"weight map has {stages} stages but num_nextn_predict_layers is {declared} (using {stages})",
            level="warning")
    hidden, vocab = cfg.get("hidden_size"), cfg.get("vocab_size")
    rank = cfg.get(lay.markov_rank_key)
    if have(lay.markov_embed):
        shape = ckpt.tensor(lay.markov_embed).shape
        add(rank == shape[-1], "markov_rank", f"markov rank {rank} matches {lay.markov_embed} {list(shape)}",
            f"{lay.markov_rank_key}={rank} but {lay.markov_embed} is {list(shape)}")
    elif lay.markov_rank_key in cfg:
        add(not rank, "markov_rank", "no Markov head and markov rank 0",
            f"{lay.markov_rank_key}={rank} but the checkpoint has no Markov head")
    noise = cfg.get(lay.noise_token_key)
    if noise is not None or lay.key != "v4-preview-mtp":
        add(isinstance(noise, int) and isinstance(vocab, int) and 0 <= noise < vocab, "noise_token",
            f"{lay.noise_token_key} {noise} < vocab {vocab}", f"{lay.noise_token_key}={noise} not in [0, vocab {vocab})")
    taps, n_layers = cfg.get(lay.target_layers_key), cfg.get(lay.num_layers_key)
    if taps is not None or lay.key != "v4-preview-mtp":
        ok = isinstance(taps, list) and isinstance(n_layers, int) and all(isinstance(t, int) and -1 <= t < n_layers
                                                                         for t in taps)
        add(ok, "target_layers", f"{lay.target_layers_key} {taps} < {lay.num_layers_key} {n_layers}",
            f"{lay.target_layers_key}={taps} not all in [-1, {lay.num_layers_key} {n_layers})")
        if ok and have(lay.main_proj) and isinstance(hidden, int):
            shape = ckpt.tensor(lay.main_proj).shape
            add(list(shape) == [hidden, len(taps) * hidden], "main_proj",
                f"{lay.main_proj} {list(shape)} = [hidden, {len(taps)} taps x hidden]",
                f"{lay.main_proj} is {list(shape)}, expected [{hidden}, {len(taps) * hidden}]")
    if have(lay.confidence):
        shape = ckpt.tensor(lay.confidence).shape
        width = (hidden or 0) + (rank or 0)
        add(shape[-1] == width, "confidence_head", f"confidence head width {shape[-1]} = hidden + rank",
            f"{lay.confidence} is {list(shape)}, expected width hidden {hidden} + rank {rank} = {width}")
    if lay.key != "v4-preview-mtp":
        block = cfg.get(lay.block_size_key)
        add(isinstance(block, int) and not isinstance(block, bool) and block > 0, "block_size", f"{lay.block_size_key} = {block}",
            f"{lay.block_size_key} missing or not a positive int ({block!r})")
    out += scale_findings(ckpt)
    return out


def scale_findings(ckpt: Checkpoint) -> list[Finding]:
    """Scales present (else the reader already refused), e8m0, and shaped for the declared block;
    quantized weights 2-D (the only shape the dequantizers and the scale layout define)."""
    block = fp8_block(ckpt.config, ckpt.layout)
    names = ckpt.draft_names()
    check_scales(ckpt, names)
    bad, n = [], 0
    for name in names:
        weight = ckpt.tensor(name)
        kind = quant_kind(weight)
        if not kind:
            continue
        n += 1
        scale = ckpt.tensor(scale_name(name))
        want = expected_scale_shape(kind, weight.shape, block)
        if want is None:
            bad.append(f"{name} is {len(weight.shape)}-D {weight.dtype} {list(weight.shape)}, "
                       "quantized weights must be 2-D")
        elif scale.dtype != "F8_E8M0":
            bad.append(f"{scale.name} is {scale.dtype}, scales of {weight.dtype} weights must be F8_E8M0")
        elif tuple(scale.shape) != want:
            bad.append(f"{scale.name} {list(scale.shape)} != {list(want)} for block {block[0]}x{block[1]}")
    if bad:
        return [Finding("error", "scales", f"{len(bad)} quantized weight(s) with unusable scales: {bad[0]}")]
    return [Finding("ok", "scales", f"{n} quantized weights, every scale present and shaped for "
                                    f"block {block[0]}x{block[1]} (fp8) / 32 (fp4)")]


def inspect_report(ckpt: Checkpoint) -> dict[str, Any]:
    """Everything `dsparkctl inspect` shows, as plain data."""
    names = ckpt.draft_names()
    block = fp8_block(ckpt.config, ckpt.layout)
    comps = component_table(ckpt, names, block)
    shards = draft_shards(ckpt, names)
    head = [n for n in ckpt.layout.head_names if n in ckpt.weight_map]
    shard_bytes = {f: ckpt.headers[f].file_size for f in shards}
    return {
        "source": ckpt.source,
        "revision": ckpt.revision,
        "layout": {"key": ckpt.layout.key, "title": ckpt.layout.title},
        "stages": stage_count(ckpt),
        "fp8_block": list(block),
        "components": [c.as_dict() for c in comps],
        "draft": {"tensors": len(names), "params": sum(c.params for c in comps),
                  "bytes": sum(c.nbytes for c in comps)},
        "draft_shards": [{"file": f, "bytes": b} for f, b in shard_bytes.items()],
        "head_shards": sorted({ckpt.weight_map[n] for n in head}),
        "download": {"draft_only_bytes": sum(shard_bytes.values()), "total_bytes": ckpt.total_size,
                     "shards": len(shards), "total_shards": len(ckpt.headers)},
        "config": dspark_fields(ckpt.config),
        "findings": [f.as_dict() for f in consistency(ckpt)],
    }
