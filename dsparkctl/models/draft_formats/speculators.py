"""vLLM's `speculators` (PyPI `speculators`, models/dspark/): `DSparkSpeculatorConfig` folders.

config.json: `speculators_model_type: "dspark"`, `architectures: ["DSparkSpeculator"]`,
`speculators_version`, the draft's layers in a nested `transformer_layer_config` (a Qwen3 config
diff: widths, heads, draft layer count, RoPE, norm eps, the target's vocabulary size), the DSpark
fields at the top level (`block_size`, `mask_token_id`, `aux_hidden_state_layer_ids`,
`draft_vocab_size`, `target_hidden_size`, `sample_from_anchor`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`) and the target in
`speculators_config.verifier.{name_or_path, architectures}`.

Tensors carry the canonical names; a reduced vocabulary is `d2t` [K] int64 offsets (target id =
i + d2t[i]) with `t2d` [V] bool and `lm_head.weight` [K, H] (the target head's rows, which its
runtime cannot cut itself); a full-vocabulary draft has none of the three. `embed_tokens.weight`
is never saved. Its save also writes `config.py` (the config class's source) and an `auto_map`:
dsparkctl never runs either.
Layer ids count transformers' `hidden_states` index: written id = canonical id + 1 (0 = the
embeddings).
"""

from __future__ import annotations

from typing import Any

from dsparkctl.errors import CheckpointError
from dsparkctl.models.draft_config import typed_field
from dsparkctl.models.draft_formats.base import CanonicalDraft, DraftFormat, FileFacts

TOP_KEYS = ("block_size", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov", "sample_from_anchor")
VERSION = "0.9.0"  # the speculators release whose classes read and wrote our fixtures


def _claims_config(cfg: dict[str, Any]) -> bool:
    return "speculators_model_type" in cfg or "speculators_config" in cfg


def _claims_tensors(names: set[str]) -> bool:
    return "fc.weight" in names and "hidden_norm.weight" in names and "markov_w1.weight" not in names \
        and "confidence_proj.weight" not in names


def _read_config(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], FileFacts]:
    kind = raw.get("speculators_model_type")
    if kind not in ("dspark", "dflash"):
        raise CheckpointError(f"{where}: speculators_model_type {kind!r} is not a DSpark or DFlash draft",
                              "dsparkctl reads speculators' dspark and dflash drafts")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{where}: transformer_layer_config must be an object (the draft layers' config)",
                              "restore the config.json saved with these weights")
    ids = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{where}: aux_hidden_state_layer_ids must be a list of integers, got {ids!r}"[:200],
                              "restore the config.json saved with these weights")
    flat: dict[str, Any] = {k: v for k, v in layer.items()}
    flat.update({k: raw[k] for k in TOP_KEYS if k in raw})
    for key, kind in (("markov_rank", int), ("enable_confidence_head", bool), ("confidence_head_with_markov", bool),
                      ("sample_from_anchor", bool), ("draft_vocab_size", int)):
        typed_field(raw, key, kind, source=where)  # typed before any default is derived from them
    if isinstance(raw.get("dtype"), str):
        flat["dtype"] = raw["dtype"]
    flat["target_layer_ids"] = [i - 1 for i in ids]
    if kind == "dflash":
        flat.setdefault("markov_rank", 0)
        flat.setdefault("enable_confidence_head", False)
    flat.setdefault("sample_from_anchor", kind == "dspark")  # the classes' own defaults
    flat.setdefault("enable_confidence_head", True)
    flat.setdefault("confidence_head_with_markov", bool(flat["enable_confidence_head"]) and flat.get("markov_rank", 256) > 0)
    flat.setdefault("markov_rank", 256)
    if raw.get("draft_vocab_size") is not None:  # = the target's vocabulary when there is no map (checked on read)
        flat["draft_vocab_size"] = raw["draft_vocab_size"]
    verifier = (raw.get("speculators_config") or {}).get("verifier") if isinstance(raw.get("speculators_config"), dict) else None
    target = {k: verifier[k] for k in ("name_or_path", "architectures") if k in verifier} if isinstance(verifier, dict) else None
    flat["architectures"] = ["Qwen3DSparkModel"]
    flat["num_target_layers"] = _tool(raw).get("num_target_layers", 0)
    stated = "sample_from_anchor" in raw
    sliding = [i for i, t in enumerate(layer.get("layer_types") or []) if t == "sliding_attention"]
    warnings = (f"draft layers {sliding} use sliding-window attention (window {layer.get('sliding_window')}): "
                "dsparkctl's draft attends to the whole context, the same up to that many context tokens",) if sliding else ()
    flat.pop("layer_types", None)
    facts = FileFacts(layer_ids_key="aux_hidden_state_layer_ids", layer_ids=tuple(ids), layer_rule=SPECULATORS.layer_rule,
                      slot_stated=stated, slot_rule="config: sample_from_anchor" if stated else
                      f"implied: speculators' {kind} default ({flat['sample_from_anchor']})",
                      version=raw.get("speculators_version") if isinstance(raw.get("speculators_version"), str) else None,
                      target=target or None, warnings=warnings)
    return flat, facts


def _tool(raw: dict[str, Any]) -> dict[str, Any]:
    block = raw.get("dsparkctl")
    return block if isinstance(block, dict) else {}


def _write_config(draft: CanonicalDraft) -> dict[str, Any]:
    c = draft.config
    base = c.to_dict()
    skip = set(TOP_KEYS) | {"target_layer_ids", "num_target_layers", "draft_vocab_size", "num_anchors", "qk_norm",
                            "architectures", "dsparkctl", "auto_map", "dtype", "torch_dtype", "transformers_version",
                            "_name_or_path", "speculators_version"}
    layer = {k: v for k, v in base.items() if k not in skip}  # the rest describes the draft's layers
    layer.update(model_type="qwen3", num_hidden_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
                 layer_types=["full_attention"] * c.num_hidden_layers, tie_word_embeddings=False)
    if "rope_parameters" not in layer:
        layer["rope_parameters"] = {"rope_theta": c.rope_theta, "rope_type": "default"}
    target = (draft.facts.target if draft.facts and draft.facts.target else None) or {}
    algorithm = "dspark" if c.markov_rank > 0 or c.enable_confidence_head else "dflash"
    return {
        **({"dtype": base["dtype"]} if isinstance(base.get("dtype"), str) else {}),
        "speculators_model_type": "dspark",
        "architectures": ["DSparkDraftModel"],
        "speculators_version": VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": c.sample_from_anchor,
        "markov_rank": c.markov_rank,
        "markov_head_type": c.markov_head_type,
        "enable_confidence_head": c.enable_confidence_head,
        "confidence_head_with_markov": c.confidence_head_with_markov,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.drafts_per_block,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.get("name_or_path"), "architectures": target.get("architectures", [])},
        },
        "dsparkctl": {"num_target_layers": c.num_target_layers},
    }


SPECULATORS = DraftFormat(
    key="speculators", title="vLLM speculators DSpark draft", trainer="vLLM speculators",
    claims_config=_claims_config, claims_tensors=_claims_tensors,
    layer_offset=1, names_target=True, layer_rule="id = transformers hidden_states index (canonical id + 1; 0 = embeddings)",
    vocab="d2t", needs=lambda cfg: ("lm_head.weight",) if cfg.draft_vocab_size else (), read_config=_read_config, write_config=_write_config,
)
