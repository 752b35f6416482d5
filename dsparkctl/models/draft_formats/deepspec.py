"""DeepSpec's draft folders (deepseek-ai/DeepSpec), which dsparkctl also writes for its own drafts.

config.json is a copy of the target's config with the draft's fields at the top level
(`block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`); the tensors carry
the canonical names. Ids count DeepSpec's way (the canonical one). DeepSpec has no field for the
slot convention: its drafts sample from the anchor (slot k predicts token p+k+1); dsparkctl writes
`sample_from_anchor: false` for a draft that does not. A reduced vocabulary is dsparkctl's
`draft_vocab_ids` [K] + `draft_vocab_size` (dsparkctl's earlier vLLM export wrote `d2t` instead;
both are read).
"""

from __future__ import annotations

from typing import Any

from dsparkctl.models.draft_formats.base import TOOL_KEY, CanonicalDraft, DraftFormat, FileFacts, has_any


def _claims_config(cfg: dict[str, Any]) -> bool:
    flat = {**cfg.get("text_config", {}), **cfg} if isinstance(cfg.get("text_config"), dict) else cfg
    return ("target_layer_ids" in flat or "dspark_target_layer_ids" in flat or isinstance(flat.get("dspark_config"), dict)) \
        and not any(k.startswith("speculators") for k in cfg) and "dflash_config" not in cfg


def _claims_tensors(names: set[str]) -> bool:
    return "fc.weight" in names and "hidden_norm.weight" in names and not has_any(
        names, r"markov_w1\.weight$", r"confidence_proj\.", r"t2d$", r"logit_head\.")


def _read_config(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], FileFacts]:
    ids = raw.get("target_layer_ids")
    if ids is None and isinstance(raw.get("text_config"), dict):
        ids = raw["text_config"].get("target_layer_ids")
    stated = "sample_from_anchor" in raw
    facts = FileFacts(
        layer_ids_key="target_layer_ids", layer_ids=tuple(ids) if isinstance(ids, list) else (),
        layer_rule=DEEPSPEC.layer_rule, slot_stated=stated,
        slot_rule="config: sample_from_anchor" if stated else "implied: DeepSpec drafts sample from the anchor",
        quantization=None)
    return dict(raw), facts


def _write_config(draft: CanonicalDraft) -> dict[str, Any]:
    cfg = draft.config.to_dict()
    cfg.pop(TOOL_KEY, None)  # registry.write adds a fresh block
    return cfg


DEEPSPEC = DraftFormat(
    key="deepspec", title="DeepSpec draft (also dsparkctl's own)", trainer="DeepSpec, dsparkctl train",
    claims_config=_claims_config, claims_tensors=_claims_tensors,
    vocab="index", read_config=_read_config, write_config=_write_config,
    notes=("embed_tokens/lm_head are optional copies of the target's; dsparkctl borrows the target's",),
)
