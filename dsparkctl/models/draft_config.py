"""Draft configuration, read from / written to DeepSpec's `config.json` layout.

DeepSpec's draft config is a copy of the target's config (so `vocab_size`, `hidden_size`,
`rope_theta`, ... describe the shared embedding space), with `num_hidden_layers` overwritten by
the number of DRAFT layers and these extra fields: `block_size`, `mask_token_id`,
`target_layer_ids`, `num_target_layers`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`, `num_anchors`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from dsparkctl.errors import CheckpointError, option

# `architectures` we can load: DeepSpec's Qwen3 draft class (DSpark and DFlash share it).
KNOWN_ARCHITECTURES = frozenset({"Qwen3DSparkModel"})
DSPARK_KEYS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
               "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_anchors",
               "sample_from_anchor")


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


MAX_BLOCK_SIZE = 256  # γ: drafts per round; published drafts use 4–16

_KIND_NAMES = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


def typed_field(d: dict[str, Any], key: str, kind: type, default: Any = None, minimum: float | None = None,
                source: str = "config.json") -> Any:
    """d[key] typed strictly (null or absent: `default`): ints are JSON integers (not 4.0, "4" or
    true), floats finite numbers, flags true/false; CheckpointError naming the field otherwise."""
    val = d.get(key)
    if val is None:
        val = default
    if val is None:
        return None
    if kind is bool:
        ok = isinstance(val, bool)
    elif kind is int:
        ok = isinstance(val, int) and not isinstance(val, bool)
    elif kind is float:
        ok = isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val)
    else:
        ok = isinstance(val, kind)
    if not ok:
        raise CheckpointError(f"{source}: {key} must be {_KIND_NAMES[kind]}, got {json.dumps(val)[:40]}",
                              "fix config.json (it is not the draft this tool or DeepSpec writes)")
    if minimum is not None and val < minimum:
        raise CheckpointError(f"{source}: {key} must be >= {minimum}, got {val}", "fix config.json")
    return kind(val)


def check_architectures(d: dict[str, Any], source: str = "config.json") -> None:
    """Refuse a config whose `architectures` name a class we cannot load (KNOWN_ARCHITECTURES)."""
    arch = d.get("architectures")
    if arch is None:
        return
    if not (isinstance(arch, str) or isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise CheckpointError(f"{source}: architectures must be a list of class names", "fix config.json")
    names = arch if isinstance(arch, list) else [arch]
    unknown = [str(a) for a in names if a not in KNOWN_ARCHITECTURES]
    if any("Gemma4" in a for a in unknown):
        raise CheckpointError(f"{source}: architectures {unknown}: Gemma-4 DSpark drafts are not supported yet",
                              f"dsparkctl loads {', '.join(sorted(KNOWN_ARCHITECTURES))} drafts")
    if unknown:
        raise CheckpointError(f"{source}: unknown draft architectures {unknown}",
                              f"dsparkctl loads {', '.join(sorted(KNOWN_ARCHITECTURES))} drafts")


REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "block_size", "mask_token_id",
            "target_layer_ids")


def draft_fields(d: Any, source: str = "config.json") -> dict[str, Any]:
    """A config.json object's fields in one flat dict: a multimodal config's `text_config` merged in
    (when the top level has no hidden_size), the nested draft fields resolved (`resolve_nested`);
    refused when it is not an object, names an unknown architecture or lacks a REQUIRED field."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{source}: expected a JSON object", "config.json must be a JSON object of the draft's settings")
    check_architectures(d, source)
    if "text_config" in d and d.get("hidden_size") is None:
        if not isinstance(d["text_config"], dict):
            raise CheckpointError(f"{source}: text_config must be an object", "fix config.json")
        d = {**d["text_config"], **{k: v for k, v in d.items() if k != "text_config"}}
    d = resolve_nested(d)
    missing = [k for k in REQUIRED if d.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: not a DSpark/DFlash draft config, missing {', '.join(missing)}",
                              f"point {option('draft')} at a DeepSpec draft folder (config.json + model.safetensors)")
    return d


def with_rope_theta(d: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """`d` with `rope_theta` taken from `rope_parameters` / `rope_scaling` when only they hold it;
    a RoPE type other than the default is refused (the draft implements the default only)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", None):
        raise CheckpointError(f"{source}: RoPE type {rope_type!r} is not supported by the draft",
                              "drafts with default RoPE (Qwen3, Llama without scaling) are supported")
    if "rope_theta" not in d and isinstance(rope, dict) and rope.get("rope_theta") is not None:
        d = {**d, "rope_theta": rope["rope_theta"]}
    return d


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
    # Which token a block slot predicts (docs/formats.md, "Conventions"): True (DeepSpec, DeepSeek,
    # SpecForge, speculators' DSpark default) = slot k predicts the anchor's (k+1)-th successor, so a
    # block of `block_size` slots drafts `block_size` tokens; False (DFlash's default) = slot 0 holds
    # the anchor and predicts nothing, slot k predicts the k-th successor: `block_size - 1` drafts.
    sample_from_anchor: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the rest of config.json

    @property
    def output_vocab_size(self) -> int:
        """Columns of the draft's logits: K with a reduced vocabulary, else the target's V."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def drafts_per_block(self) -> int:
        """γ, the tokens one block drafts: every slot's, or every slot's but the anchor's."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def slot_offset(self) -> int:
        """The first slot whose output is a draft (0 or 1, `sample_from_anchor`)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def kind(self) -> str:
        return "dspark" if self.markov_rank > 0 else "dflash"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "DraftConfig":
        """The draft config of a `config.json` object, every field typed strictly (`typed_field`) and
        the whole validated; CheckpointError naming the field otherwise."""
        d = draft_fields(d, source)

        def get(key: str, kind: type, default: Any = None, minimum: float | None = None) -> Any:
            return typed_field(d, key, kind, default, minimum, source)

        hidden = get("hidden_size", int, minimum=1)
        heads = get("num_attention_heads", int, minimum=1)
        d = with_rope_theta(d, source)
        ids = d["target_layer_ids"]
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CheckpointError(f"{source}: target_layer_ids must be a list of integers", "fix config.json")
        enable_conf = get("enable_confidence_head", bool, False)
        head_type = get("markov_head_type", str, "vanilla") or "vanilla"
        if head_type not in ("vanilla", "gated", "rnn"):
            raise CheckpointError(f"{source}: markov_head_type {head_type!r} is unknown", "use vanilla, gated or rnn")
        cfg = cls(
            vocab_size=get("vocab_size", int, minimum=1),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size", int, 4 * hidden, minimum=1),
            num_hidden_layers=get("num_hidden_layers", int, minimum=1),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", int, heads, minimum=1),
            head_dim=get("head_dim", int, hidden // heads, minimum=1) or hidden // heads,
            block_size=get("block_size", int),
            mask_token_id=get("mask_token_id", int),
            target_layer_ids=tuple(ids),
            num_target_layers=get("num_target_layers", int, 0, minimum=0),
            markov_rank=get("markov_rank", int, 0, minimum=0),
            markov_head_type=head_type,
            enable_confidence_head=enable_conf,
            confidence_head_with_markov=get("confidence_head_with_markov", bool, False) and enable_conf,
            num_anchors=get("num_anchors", int, 512, minimum=0) or 512,
            draft_vocab_size=get("draft_vocab_size", int, 0),
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=get("rope_theta", float, 10000.0),
            attention_bias=get("attention_bias", bool, False),
            qk_norm=get("qk_norm", bool, True),
            sample_from_anchor=get("sample_from_anchor", bool, True),
            extra={k: v for k, v in d.items()},
        )
        if not (cfg.rms_norm_eps > 0 and cfg.rope_theta >= 1):
            raise CheckpointError(f"{source}: rms_norm_eps must be > 0 and rope_theta >= 1 "
                                  f"(got {cfg.rms_norm_eps}, {cfg.rope_theta})", "fix config.json")
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        def bad(msg: str, hint: str = "fix config.json, or restore the one saved with these weights") -> None:
            raise CheckpointError(f"{source}: {msg}", hint)
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            bad(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.drafts_per_block < 1:
            bad("block_size 1 with sample_from_anchor false drafts nothing", "use block_size >= 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            bad(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})")
        if not self.target_layer_ids:
            bad("target_layer_ids is empty")
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            bad(f"target_layer_ids must be strictly increasing, got {list(self.target_layer_ids)}")
        if min(self.target_layer_ids) < -1:
            bad(f"target layer ids count decoder layers from 0 (-1 = the embeddings), got {list(self.target_layer_ids)}")
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
            if (f.name == "draft_vocab_size" and not v) or (f.name == "sample_from_anchor" and v):
                d.pop(f.name, None)  # DeepSpec's own defaults stay out: its configs stay exactly DeepSpec's
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
