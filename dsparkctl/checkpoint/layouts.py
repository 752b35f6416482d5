"""Known draft layouts, as data. Detection uses tensor names (and sizes), never `architectures`.

Each layout says which tensor names mark it, which tensors are the draft, which are the target's
embedding/head the draft borrows, and where its DSpark fields live in `config.json`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from dsparkctl.errors import CheckpointError


@dataclass(frozen=True)
class Layout:
    key: str  # short id used in JSON output, e.g. "v4.1-flash"
    title: str  # human name
    markers: tuple[str, ...]  # every one of these tensor names must be present
    forbidden_prefixes: tuple[str, ...] = ()  # no tensor name may start with one of these
    hidden_size: int | None = None  # tie-break between layouts sharing names (0731 vs Pro)
    draft_pattern: str = r"^mtp\.\d+\."  # regex selecting draft tensors
    head_names: tuple[str, ...] = ("embed.weight", "head.weight")  # borrowed from the target
    stage_pattern: str | None = r"^mtp\.(\d+)\."  # group draft tensors into stages
    # config field names (looked up in text_config first, then the root)
    block_size_key: str = "dspark_block_size"
    noise_token_key: str = "dspark_noise_token_id"
    target_layers_key: str = "dspark_target_layer_ids"
    markov_rank_key: str = "dspark_markov_rank"
    num_layers_key: str = "num_hidden_layers"
    markov_embed: str | None = None  # tensor whose dim 1 is the Markov rank
    confidence: str | None = None  # confidence head weight [1, hidden + rank]
    main_proj: str | None = "mtp.0.main_proj.weight"
    default_block: int = 128  # FP8 block when the config does not say

    def is_draft(self, name: str) -> bool:
        return re.match(self.draft_pattern, name) is not None and name not in self.head_names

    def stage_of(self, name: str) -> int | None:
        if self.stage_pattern is None:
            return None
        m = re.match(self.stage_pattern, name)
        return int(m.group(1)) if m else None


_DEEPSPEC = dict(
    draft_pattern=r"^(?!embed_tokens\.|lm_head\.)", head_names=("embed_tokens.weight", "lm_head.weight"),
    stage_pattern=None, block_size_key="block_size", noise_token_key="mask_token_id",
    target_layers_key="target_layer_ids", markov_rank_key="markov_rank", num_layers_key="num_target_layers",
    main_proj="fc.weight", default_block=128,
)

LAYOUTS: tuple[Layout, ...] = (
    Layout("v4.1-flash", "DeepSeek-V4.1-Flash (DSpark, 3 stages)",
           markers=("mtp.0.main_proj.weight", "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight"),
           markov_embed="mtp.2.markov_head.embed.weight", confidence="mtp.2.confidence_head.proj.weight",
           default_block=32),
    Layout("v4-pro-dspark", "DeepSeek-V4-Pro-DSpark", hidden_size=7168,
           markers=("mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight"),
           markov_embed="mtp.2.markov_head.markov_w1.weight", confidence="mtp.2.confidence_head.proj.weight"),
    Layout("v4-flash-dspark-0731", "DeepSeek-V4-Flash-DSpark / -0731",
           markers=("mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight"),
           markov_embed="mtp.2.markov_head.markov_w1.weight", confidence="mtp.2.confidence_head.proj.weight"),
    Layout("v4-preview-mtp", "DeepSeek-V4 preview (legacy MTP, no DSpark)",
           markers=("mtp.0.e_proj.weight", "mtp.0.h_proj.weight"), main_proj=None),
    Layout("deepspec-dspark", "DeepSpec DSpark draft",
           markers=("fc.weight", "hidden_norm.weight", "markov_head.markov_w1.weight"),
           markov_embed="markov_head.markov_w1.weight", confidence="confidence_head.proj.weight", **_DEEPSPEC),
    Layout("deepspec-dflash", "DeepSpec DFlash draft (no Markov/confidence head)",
           markers=("fc.weight", "hidden_norm.weight"), forbidden_prefixes=("markov_head.", "confidence_head."),
           **_DEEPSPEC),
)


def detect(names: Iterable[str], shapes: dict[str, tuple[int, ...]], source: str) -> Layout:
    """Pick the first layout whose markers are all present (hidden size breaks 0731/Pro ties)."""
    names = set(names)
    for layout in LAYOUTS:
        if not all(m in names for m in layout.markers):
            continue
        if any(n.startswith(p) for p in layout.forbidden_prefixes for n in names):
            continue
        if layout.hidden_size is not None and layout.main_proj in shapes:
            if shapes[layout.main_proj][0] != layout.hidden_size:
                continue
        elif layout.hidden_size is not None:
            continue
        return layout
    raise CheckpointError(
        f"{source}: no draft tensors of a known layout (looked for mtp.* and DeepSpec fc/hidden_norm)",
        hint="point at a DeepSeek-V4.x checkpoint with mtp.* tensors or a DeepSpec draft")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """V4.1 nests model fields under `text_config`; merge them over the root for lookups."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else dict(config)


def dspark_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The draft-related config fields (V4 `dspark_*` and DeepSpec's names), as found."""
    flat = text_config(config)
    keys = [k for k in flat if k.startswith("dspark_")]
    keys += [k for k in ("num_nextn_predict_layers", "block_size", "mask_token_id", "target_layer_ids",
                         "num_target_layers", "markov_rank", "markov_head_type", "enable_confidence_head",
                         "confidence_head_with_markov") if k in flat]
    return {k: flat[k] for k in keys}


def fp8_block(config: dict[str, Any], layout: Layout) -> tuple[int, int]:
    """FP8 weight block from `quantization_config.weight_block_size`, else the layout default.

    A block size that is present but not two positive ints is an error, never replaced silently."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json: quantization_config is {type(q).__name__}, not an object",
                              hint="fix config.json")
    block = q.get("weight_block_size")
    if block is None:
        return layout.default_block, layout.default_block
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size {block!r} is not two positive "
                              "integers", hint="fix config.json, e.g. \"weight_block_size\": [128, 128]")
    return block[0], block[1]
