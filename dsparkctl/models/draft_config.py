"""Draft configuration, read from / written to DeepSpec's `config.json` layout.

DeepSpec's draft config is a copy of the target's config (so `vocab_size`, `hidden_size`,
`rope_theta`, ... describe the shared embedding space), with `num_hidden_layers` overwritten by
the number of DRAFT layers and these extra fields: `block_size`, `mask_token_id`,
`target_layer_ids`, `num_target_layers`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`, `num_anchors`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dsparkctl.errors import CheckpointError


# `architectures` we can load: DeepSpec's Qwen3 draft class (DSpark and DFlash share it).
KNOWN_ARCHITECTURES = frozenset({"Qwen3DSparkModel"})
DSPARK_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
               "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_anchors")


def resolve_nested(d: dict[str, Any]) -> dict[str, Any]:
    """Flatten the draft fields that SGLang and vLLM read from nested dicts, in their precedence:
    a prefixed top-level `dspark_<key>`, then `dspark_config[key]`, then `dflash_config[key]`,
    then the top-level `key` (SGLang `parse_dflash_draft_config` / `parse_dspark_draft_config`;
    vLLM reads `dflash_config` before the top level too)."""
    nested = [d.get("dspark_config"), d.get("dflash_config")]
    out = dict(d)
    for key in DSPARK_KEYS:
        for source in [{f"dspark_{key}": d.get(f"dspark_{key}")} if f"dspark_{key}" in d else None, *nested]:
            if isinstance(source, dict):
                val = source.get(f"dspark_{key}", source.get(key))
                if val is not None:
                    out[key] = val
                    break
    return out


@dataclass(frozen=True)
class DraftConfig:
    vocab_size: int  # shared with the target
    hidden_size: int  # shared with the target (draft width = target width)
    intermediate_size: int  # draft MLP width
    num_hidden_layers: int  # number of DRAFT layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int  # γ: slots per block = drafts per round
    mask_token_id: int  # id embedded in slots 1..γ-1
    target_layer_ids: tuple[int, ...]  # tapped target layers (output of layer i; -1 = embeddings)
    num_target_layers: int  # layers of the target the draft was trained for
    markov_rank: int = 0  # r; 0 = no Markov head (DFlash)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False  # confidence input [h; W1[x_{k-1}]] vs [h]
    num_anchors: int = 512  # training-time anchors per sequence (kept for DeepSpec compatibility)
    draft_vocab_size: int = 0  # K > 0: the head covers K target ids (tensor draft_vocab_ids); 0 = full
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    qk_norm: bool = True  # Qwen3-style per-head q/k RMSNorm (DeepSpec drafts always have it)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the rest of config.json

    @property
    def output_vocab_size(self) -> int:
        """Columns of the draft's logits: K with a reduced vocabulary, else the target's V."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def kind(self) -> str:
        return "dspark" if self.markov_rank > 0 else "dflash"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DraftConfig":
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: expected a JSON object")
        arch = d.get("architectures")
        if arch is not None:
            names = arch if isinstance(arch, list) else [arch]
            unknown = [str(a) for a in names if a not in KNOWN_ARCHITECTURES]
            if any("Gemma4" in a for a in unknown):
                raise CheckpointError(f"{source}: architectures {unknown}: Gemma-4 DSpark drafts are not supported yet",
                                      f"dsparkctl loads {', '.join(sorted(KNOWN_ARCHITECTURES))} drafts")
            if unknown:
                raise CheckpointError(f"{source}: unknown draft architectures {unknown}",
                                      f"dsparkctl loads {', '.join(sorted(KNOWN_ARCHITECTURES))} drafts")
        if "text_config" in d and "hidden_size" not in d:
            d = {**d["text_config"], **{k: v for k, v in d.items() if k != "text_config"}}
        d = resolve_nested(d)
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "block_size", "mask_token_id", "target_layer_ids")
        missing = [k for k in required if k not in d]
        if missing:
            raise CheckpointError(f"{source}: not a DSpark/DFlash draft config, missing {', '.join(missing)}",
                                  "point --draft at a DeepSpec draft folder (config.json + model.safetensors)")
        heads = int(d["num_attention_heads"])
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise CheckpointError(f"{source}: RoPE type {rope_type!r} is not supported by the draft",
                                  "drafts with default RoPE (Qwen3, Llama without scaling) are supported")
        theta = d.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
        markov_rank = int(d.get("markov_rank", 0) or 0)
        enable_conf = bool(d.get("enable_confidence_head", False))
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d.get("intermediate_size", 4 * int(d["hidden_size"]))),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            block_size=int(d["block_size"]),
            mask_token_id=int(d["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in d["target_layer_ids"]),
            num_target_layers=int(d.get("num_target_layers", 0) or 0),
            markov_rank=markov_rank,
            markov_head_type=str(d.get("markov_head_type", "vanilla") or "vanilla"),
            enable_confidence_head=enable_conf,
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", False)) and enable_conf,
            num_anchors=int(d.get("num_anchors", 512) or 512),
            draft_vocab_size=int(d.get("draft_vocab_size", 0) or 0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            attention_bias=bool(d.get("attention_bias", False)),
            qk_norm=bool(d.get("qk_norm", True)),
            extra={k: v for k, v in d.items()},
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        def bad(msg: str, hint: str | None = None) -> None:
            raise CheckpointError(f"{source}: {msg}", hint)
        if self.block_size < 1:
            bad(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            bad(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if not self.target_layer_ids:
            bad("target_layer_ids is empty")
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            bad(f"target_layer_ids must be strictly increasing, got {list(self.target_layer_ids)}")
        if self.num_target_layers and max(self.target_layer_ids) >= self.num_target_layers:
            bad(f"target layer {max(self.target_layer_ids)} >= num_target_layers {self.num_target_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            bad(f"draft_vocab_size {self.draft_vocab_size} must be in [0, vocab_size={self.vocab_size}]",
                "0 means the full vocabulary")
        if self.confidence_head_with_markov and self.markov_rank == 0:
            bad("confidence_head_with_markov needs markov_rank > 0")

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if f.name == "draft_vocab_size" and not v:
                d.pop(f.name, None)  # a full-vocabulary draft's config stays exactly DeepSpec's
                continue
            d[f.name] = list(v) if isinstance(v, tuple) else v
        # What DeepSpec's build_draft_config writes, so transformers' config classes (and the
        # SGLang/vLLM/DeepSpec loaders that go through them) accept the file: one layer type per
        # DRAFT layer, untied embeddings, the draft class.
        d["architectures"] = ["Qwen3DSparkModel"]
        d["tie_word_embeddings"] = False
        if "layer_types" in d or d.get("model_type") in ("qwen3", "qwen2"):
            d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        return d

    def replace(self, **kw: Any) -> "DraftConfig":
        return dataclasses.replace(self, **kw)
