"""NVIDIA ModelOpt's DSpark drafts (PyPI `nvidia-modelopt`, speculative/plugins/modeling_dspark.py,
exported by export/plugins/hf_spec_export.py).

config.json: a Qwen3 config of the draft layers labelled `architectures: ["DFlashDraftModel"]` even
for DSpark, with `block_size` and `num_target_layers` at the top level and `dflash_config`:
`mask_token_id`, `target_layer_ids`, `causal` (false), `projector_type: "dspark"`, `shift_label`
(true: slot k predicts token p+k+1), `markov_rank`, `markov_head_type`, `use_confidence_head`.
Its confidence head always reads the Markov embedding too ([h ; W1[x]]): there is no hidden-only
variant. Layer ids count DeepSpec's way (`hidden_states[id + 1]`).

Tensors: the backbone's canonical names; the heads flat — `markov_w1`, `markov_w2`, `gate_proj`,
`joint_proj`, `confidence_proj` — and no `embed_tokens`/`lm_head`; full vocabulary. Quantized
exports add `hf_quant_config.json` (and `quantization_config`): FP8 weights `F8_E4M3` with scalar
F32 `weight_scale` (value = w · weight_scale) and `input_scale`; NVFP4 weights `U8` [out, in/2]
(two e2m1 codes a byte, even index in the low nibble) with `weight_scale` F8_E4M3 [out, in/16] and
scalar F32 `weight_scale_2` (value = e2m1 · weight_scale · weight_scale_2). Read only: they are
dequantized to the config's dtype; converting one is a change (`--drop quantization`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dsparkctl.errors import CheckpointError
from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.models.draft_formats.base import TOOL_KEY, CanonicalDraft, DraftFormat, FileFacts, has_any

QUANT_FILE = "hf_quant_config.json"
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
NVFP4_GROUP = 16
DROP_FROM_TARGET = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
                    "enable_confidence_head", "confidence_head_with_markov", "num_anchors", "qk_norm",
                    "draft_vocab_size", "dtype")


def _nested(cfg: dict[str, Any]) -> dict[str, Any] | None:
    d = cfg.get("dflash_config")
    return d if isinstance(d, dict) else None


def _claims_config(cfg: dict[str, Any]) -> bool:
    d = _nested(cfg)
    return d is not None and ("use_confidence_head" in d or "shift_label" in d or "causal" in d)


def _claims_tensors(names: set[str]) -> bool:
    return "fc.weight" in names and "hidden_norm.weight" in names and not has_any(names, r"t2d$", r"d2t$") and (
        has_any(names, r"markov_w1\.weight$", r"confidence_proj\.") or not has_any(names, r"markov_head\.",
                                                                                   r"confidence_head\."))


def _read_config(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], FileFacts]:
    d = _nested(raw) or {}
    for key, why in (("causal", "causal draft attention"), ("use_swa", "sliding-window draft attention"),
                     ("attention_sink_bias", "an attention sink")):
        if d.get(key):
            raise CheckpointError(f"{where}: dflash_config.{key} is set: {why} is not supported by dsparkctl's draft",
                                  "dsparkctl runs non-causal full-attention DSpark/DFlash drafts")
    projector = d.get("projector_type")
    if projector not in (None, "dspark"):
        raise CheckpointError(f"{where}: dflash_config.projector_type {projector!r} is not a DSpark draft",
                              "dsparkctl reads ModelOpt's dspark exports (projector_type \"dspark\")")
    dspark = projector == "dspark"
    flat = {k: v for k, v in raw.items() if k not in ("dflash_config", "quantization_config")}
    flat.update(mask_token_id=d.get("mask_token_id"), target_layer_ids=d.get("target_layer_ids"),
                markov_rank=d.get("markov_rank", 0) if dspark else 0,
                markov_head_type=d.get("markov_head_type", "vanilla"),
                enable_confidence_head=bool(d.get("use_confidence_head", False)) and dspark,
                architectures=["Qwen3DSparkModel"], qk_norm=True)
    flat["confidence_head_with_markov"] = flat["enable_confidence_head"] and bool(flat["markov_rank"])
    stated = "shift_label" in d
    flat["sample_from_anchor"] = bool(d.get("shift_label", dspark))
    if isinstance(raw.get("torch_dtype"), str) and "dtype" not in flat:
        flat["dtype"] = raw["torch_dtype"]
    quant = raw.get("quantization_config") if isinstance(raw.get("quantization_config"), dict) else None
    quant = quant.get("quantization", quant).get("quant_algo") if isinstance(quant, dict) else None
    ids = d.get("target_layer_ids")
    facts = FileFacts(layer_ids_key="dflash_config.target_layer_ids",
                      layer_ids=tuple(ids) if isinstance(ids, list) else (), layer_rule=MODELOPT.layer_rule,
                      slot_stated=stated, slot_rule="config: dflash_config.shift_label" if stated else
                      "implied: ModelOpt's DSpark shifts labels (slot k predicts p+k+1)", quantization=quant)
    return flat, facts


def _dtype(cfg: DraftConfig) -> torch.dtype:
    name = cfg.extra.get("torch_dtype") or cfg.extra.get("dtype") or "bfloat16"
    return {"float32": torch.float32, "float16": torch.float16}.get(name, torch.bfloat16)


def _read_tensors(tensors: dict[str, Tensor], cfg: DraftConfig, facts: FileFacts, where: str) -> dict[str, Tensor]:
    """Dequantize FP8 / NVFP4 weights with their scales (and drop the scales)."""
    out = dict(tensors)
    dtype = _dtype(cfg)
    for name, w in tensors.items():
        if not name.endswith(".weight") or w.dtype not in (torch.float8_e4m3fn, torch.uint8):
            continue
        base = name.removesuffix(".weight")
        scale = tensors.get(base + ".weight_scale")
        if scale is None:
            raise CheckpointError(f"{where}: {name} is quantized ({w.dtype}) but {base}.weight_scale is missing",
                                  "re-export the draft with its scales (hf_quant_config.json alone is not enough)")
        if w.dtype == torch.float8_e4m3fn:
            if scale.numel() != 1:
                raise CheckpointError(f"{where}: {base}.weight_scale must be one per-tensor FP8 scale, got "
                                      f"{list(scale.shape)}", "re-export the draft")
            value = w.float() * scale.float()
        else:
            scale2 = tensors.get(base + ".weight_scale_2")
            if scale2 is None or scale.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{where}: NVFP4 weight {name} needs {base}.weight_scale (F8_E4M3) and "
                                      f"{base}.weight_scale_2", "re-export the draft with its scales")
            codes = torch.stack([w & 0x0F, w >> 4], dim=-1).reshape(w.shape[0], -1).long()  # [out, in]
            if tuple(scale.shape) != (w.shape[0], codes.shape[1] // NVFP4_GROUP):
                raise CheckpointError(f"{where}: {base}.weight_scale is {list(scale.shape)}, expected "
                                      f"[{w.shape[0]}, {codes.shape[1] // NVFP4_GROUP}]", "re-export the draft")
            block = scale.float().repeat_interleave(NVFP4_GROUP, dim=1) * scale2.float()
            value = E2M1[codes] * block
        out[name] = value.to(dtype)
        for extra in (".weight_scale", ".weight_scale_2", ".input_scale"):
            out.pop(base + extra, None)
    left = sorted(k for k in out if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")))
    if left:
        raise CheckpointError(f"{where}: scale {left[0]} belongs to no quantized weight", "re-export the draft")
    return out


def _write_config(draft: CanonicalDraft) -> dict[str, Any]:
    c = draft.config
    cfg = {k: v for k, v in c.to_dict().items() if k not in DROP_FROM_TARGET and k != TOOL_KEY}
    cfg.pop("quantization_config", None)
    cfg.update(
        architectures=["DFlashDraftModel"], model_type="qwen3", tie_word_embeddings=False,
        layer_types=["full_attention"] * c.num_hidden_layers, block_size=c.block_size,
        num_target_layers=c.num_target_layers, vocab_size=c.vocab_size,
        torch_dtype=cfg.get("torch_dtype") or "bfloat16",
        dflash_config={
            "mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids), "causal": False,
            "projector_type": "dspark", "shift_label": True, "markov_rank": c.markov_rank,
            "markov_head_type": c.markov_head_type, "use_confidence_head": c.enable_confidence_head,
        })
    return cfg


def _warnings(cfg: DraftConfig) -> list[str]:
    if len(cfg.target_layer_ids) != cfg.num_hidden_layers:
        return [f"ModelOpt's own convert requires one target layer per draft layer; this draft has "
                f"{cfg.num_hidden_layers} layers and taps {len(cfg.target_layer_ids)}: ModelOpt's warm start will "
                "refuse the file (dsparkctl, and engines that read the tensors, do not)"]
    return []


MODELOPT = DraftFormat(
    key="modelopt", title="NVIDIA ModelOpt DSpark export", trainer="NVIDIA ModelOpt",
    claims_config=_claims_config, claims_tensors=_claims_tensors,
    renames=(("markov_head.markov_w1.", "markov_w1."), ("markov_head.markov_w2.", "markov_w2."),
             ("markov_head.gate_proj.", "gate_proj."), ("markov_head.joint_proj.", "joint_proj."),
             ("confidence_head.proj.", "confidence_proj.")),
    vocab="full", holds_anchor_free_slots=False, holds_hidden_only_confidence=False, needs_markov=True,
    own_files=(QUANT_FILE,), read_config=_read_config, write_config=_write_config,
    read_tensors=_read_tensors, warnings=_warnings,
    notes=("no embed_tokens/lm_head: the target's are used", "quantized exports are read (dequantized), not written"),
)
