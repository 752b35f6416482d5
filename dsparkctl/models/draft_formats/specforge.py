"""SGLang SpecForge's DSpark drafts (PyPI `specforge`, modeling/draft/dspark.py, exported by its
`export_to_hf`, a `save_pretrained`).

config.json: a Qwen3 config of the DRAFT layers (`architectures: ["DSparkDraftModel"]`,
`model_type: "qwen3"`, `layer_types` one per draft layer) with `block_size`, `num_target_layers`
and `draft_vocab_size` (= `vocab_size`) at the top level and the DSpark fields nested in
`dflash_config`: `mask_token_id`, `target_layer_ids`, `projector_type: "dspark"`,
`attention_mode` ("gqa" when kv heads < heads, else "mha"), `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov` (its default: false).

Tensors carry the canonical names with no `embed_tokens`/`lm_head` (the target's are used) and the
Markov head at the full vocabulary; older files prefix the heads with `logit_head.` (read, never
written). Layer ids count DeepSpec's way (its capture reads `hidden_states[id + 1]`). No field
states the slot convention: its training labels slot k with token p+k+1 (sample from the anchor).
"""

from __future__ import annotations

from typing import Any

from dsparkctl.errors import CheckpointError
from dsparkctl.models.draft_formats.base import TOOL_KEY, CanonicalDraft, DraftFormat, FileFacts, has_any

NESTED = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
          "confidence_head_with_markov")
ENGINE_TOP_LEVEL = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
DROP_FROM_TARGET = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
                    "enable_confidence_head", "confidence_head_with_markov", "num_anchors", "qk_norm", "draft_vocab_size")


def _nested(cfg: dict[str, Any]) -> dict[str, Any] | None:
    d = cfg.get("dflash_config")
    return d if isinstance(d, dict) else None


def _claims_config(cfg: dict[str, Any]) -> bool:
    d = _nested(cfg)
    return d is not None and "use_confidence_head" not in d and not any(k.startswith("speculators") for k in cfg)


def _claims_tensors(names: set[str]) -> bool:
    return "fc.weight" in names and "hidden_norm.weight" in names and not has_any(
        names, r"markov_w1\.weight$", r"confidence_proj\.", r"t2d$", r"d2t$", r"draft_vocab_ids$")


def _read_config(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], FileFacts]:
    d = _nested(raw) or {}
    projector = d.get("projector_type", "dspark")
    if projector not in ("dspark", None):
        raise CheckpointError(f"{where}: dflash_config.projector_type {projector!r} is not a DSpark draft",
                              "dsparkctl reads SpecForge's dspark drafts")
    flat = {k: v for k, v in raw.items() if k != "dflash_config"}
    for key in NESTED:  # written in both places by dsparkctl (see _write_config): they must agree
        if key in d and key in raw and raw[key] != d[key]:
            raise CheckpointError(f"{where}: dflash_config.{key} is {d[key]!r} but the top-level {key} is "
                                  f"{raw[key]!r}", "make the two agree (SpecForge reads dflash_config's)")
    flat.update({k: d[k] for k in NESTED if k in d})
    flat.setdefault("markov_rank", 0)
    flat.setdefault("enable_confidence_head", False)
    flat.setdefault("confidence_head_with_markov", False)
    flat["architectures"] = ["Qwen3DSparkModel"]
    flat.pop("draft_vocab_size", None)  # the full vocabulary, always
    flat["qk_norm"] = True
    ids = d.get("target_layer_ids")
    facts = FileFacts(layer_ids_key="dflash_config.target_layer_ids",
                      layer_ids=tuple(ids) if isinstance(ids, list) else (), layer_rule=SPECFORGE.layer_rule,
                      slot_stated=False, slot_rule="implied: SpecForge trains slot k on token p+k+1 (from the anchor)")
    return flat, facts


def _write_config(draft: CanonicalDraft) -> dict[str, Any]:
    c = draft.config
    cfg = {k: v for k, v in c.to_dict().items() if k not in DROP_FROM_TARGET and k != TOOL_KEY}
    cfg.update(
        architectures=["DSparkDraftModel"], model_type="qwen3", tie_word_embeddings=False,
        layer_types=["full_attention"] * c.num_hidden_layers, block_size=c.block_size,
        num_target_layers=c.num_target_layers, draft_vocab_size=c.vocab_size, vocab_size=c.vocab_size,
        dflash_config={
            "mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
            "projector_type": "dspark",
            "attention_mode": "mha" if c.num_key_value_heads == c.num_attention_heads else "gqa",
            "markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
            "enable_confidence_head": c.enable_confidence_head,
            "confidence_head_with_markov": c.confidence_head_with_markov,
        })
    # SGLang's and vLLM's DSpark model classes read the Markov and confidence fields at the top level
    # only (their config parsers read dflash_config): without these a served draft loses its heads
    cfg.update({k: cfg["dflash_config"][k] for k in ENGINE_TOP_LEVEL})
    return cfg


SPECFORGE = DraftFormat(
    key="specforge", title="SGLang SpecForge DSpark draft", trainer="SGLang SpecForge",
    claims_config=_claims_config, claims_tensors=_claims_tensors,
    legacy_renames=(("markov_head.", "logit_head.markov_head."), ("confidence_head.", "logit_head.confidence_head.")),
    vocab="full", holds_anchor_free_slots=False, read_config=_read_config, write_config=_write_config,
    notes=("no embed_tokens/lm_head: the target's are used",),
)
