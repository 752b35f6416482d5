"""What `inspect` says of a standalone draft folder, and the checks of a draft against a target's
config that run before any forward (`pair_findings`): each mismatch one line naming file and field."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from dsparkctl.models.draft_formats.base import BORROWED, CanonicalDraft
from dsparkctl.models.draft_formats.registry import BY_KEY, tensor_names


def describe(draft: CanonicalDraft, folder: Path) -> dict[str, Any]:
    """The draft's format, conventions, vocabulary, dtypes and size, as plain data (strict-JSON safe)."""
    cfg, facts, fmt = draft.config, draft.facts, BY_KEY[draft.format]
    stored = tensor_names(folder)
    dtypes = Counter(dt for dt, _ in stored.values())
    own = draft.own_tensors
    vocab = {"map": ("d2t/t2d" if fmt.vocab == "d2t" else "draft_vocab_ids") if draft.reduced else "none (full)",
             "draft_size": cfg.output_vocab_size, "target_size": cfg.vocab_size}
    return {
        "format": {"key": fmt.key, "title": fmt.title, "trainer": fmt.trainer,
                   "version": facts.version if facts else None},
        "kind": cfg.kind,
        "block_size": cfg.block_size,
        "drafts_per_round": cfg.drafts_per_block,
        "draft_layers": cfg.num_hidden_layers,
        "markov": {"rank": cfg.markov_rank, "head_type": cfg.markov_head_type if cfg.markov_rank else None},
        "confidence_head": {"present": cfg.enable_confidence_head,
                            "reads_markov": cfg.confidence_head_with_markov if cfg.enable_confidence_head else None},
        "slot_convention": {"sample_from_anchor": cfg.sample_from_anchor,
                            "meaning": ("slot k predicts the anchor's (k+1)-th successor" if cfg.sample_from_anchor
                                        else "slot 0 holds the anchor; slot k predicts its k-th successor"),
                            "stated": facts.slot_stated if facts else True, "source": facts.slot_rule if facts else None},
        "target_layers": {"field": facts.layer_ids_key if facts else "target_layer_ids",
                          "as_written": list(facts.layer_ids) if facts else list(cfg.target_layer_ids),
                          "file_rule": facts.layer_rule if facts else fmt.layer_rule,
                          "canonical": list(cfg.target_layer_ids),
                          "canonical_rule": "id i = output of decoder layer i = transformers hidden_states[i + 1]; "
                                            "-1 = the embeddings",
                          "num_target_layers": cfg.num_target_layers or None},
        "vocabulary": vocab,
        "mask_token_id": cfg.mask_token_id,
        "hidden_size": cfg.hidden_size,
        "dtypes": dict(sorted(dtypes.items())),
        "quantization": facts.quantization if facts else None,
        "target_named": facts.target if facts else None,
        "tensors": {"stored": len(stored), "params": int(sum(t.numel() for t in own.values())),
                    "borrowed_from_target": [n for n in BORROWED if n not in draft.tensors]},
        "warnings": list(facts.warnings if facts else ()) + fmt.warnings(cfg),
        "notes": list(fmt.notes),
    }


def pair_findings(draft: CanonicalDraft, folder: Path, target_cfg: Any, target_name: str) -> list[dict[str, str]]:
    """The draft against a target's transformers config, before any forward."""
    cfg, facts = draft.config, draft.facts
    where = f"{folder}/config.json"
    tc = target_cfg.get_text_config() if hasattr(target_cfg, "get_text_config") else target_cfg
    t_hidden, t_vocab, t_layers = tc.hidden_size, tc.vocab_size, tc.num_hidden_layers
    out: list[dict[str, str]] = []

    def add(ok: bool, check: str, good: str, bad: str, level: str = "error") -> None:
        out.append({"level": "ok" if ok else level, "check": check, "message": good if ok else bad})

    add(cfg.hidden_size == t_hidden, "hidden_size", f"hidden size {cfg.hidden_size} = the target's",
        f"{where}: hidden_size {cfg.hidden_size} but target {target_name} has hidden_size {t_hidden}")
    add(cfg.vocab_size == t_vocab, "vocabulary", f"vocabulary {cfg.vocab_size} = the target's",
        f"{where}: vocab_size {cfg.vocab_size} but target {target_name} has vocab_size {t_vocab} (another tokenizer?)")
    field = facts.layer_ids_key if facts else "target_layer_ids"
    written = list(facts.layer_ids) if facts else list(cfg.target_layer_ids)
    worst = max(cfg.target_layer_ids)
    add(min(cfg.target_layer_ids) >= -1 and worst <= t_layers - 2, "target_layers",
        f"{field} {written} tap hidden_states {[i + 1 for i in cfg.target_layer_ids]} of the target's {t_layers} layers",
        f"{where}: {field} {written} reaches decoder layer {worst} (hidden_states[{worst + 1}]) but target {target_name} "
        f"has {t_layers} layers and its last is not tappable (hidden_states 0..{t_layers - 1} are)")
    if cfg.num_target_layers:
        add(cfg.num_target_layers == t_layers, "num_target_layers", f"trained for a {t_layers}-layer target",
            f"{where}: num_target_layers {cfg.num_target_layers} but target {target_name} has {t_layers} layers")
    add(0 <= cfg.mask_token_id < t_vocab, "mask_token", f"mask_token_id {cfg.mask_token_id} is in the vocabulary",
        f"{where}: mask_token_id {cfg.mask_token_id} is outside target {target_name}'s vocabulary [0, {t_vocab})")
    stated = facts.slot_stated if facts else True
    add(stated, "slot_convention", f"slot convention stated: sample_from_anchor {str(cfg.sample_from_anchor).lower()}",
        f"{where}: the slot convention is not stated ({facts.slot_rule if facts else ''}); check it with --probe",
        level="warning")
    return out
