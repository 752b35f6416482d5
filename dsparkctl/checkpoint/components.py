"""Group draft tensors into components (per stage attention, norms, experts, heads) and total them.

Logical parameters count FP4 codes, two per stored I8 byte; `.scale` tensors count as bytes on
disk and as tensors, not as parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dsparkctl.checkpoint.source import Checkpoint, logical_shape, quant_kind, scale_name

# (regex on the name after the stage prefix, component). First match wins.
_RULES: tuple[tuple[str, str], ...] = (
    (r"^ffn\.experts\.", "routed experts"),
    (r"^mlp\.", "mlp"),
    (r"^ffn\.shared_experts\.", "shared expert"),
    (r"^ffn\.gate\.", "gate"),
    (r"^(attn|self_attn)\.", "attention"),
    (r"^hc_head_", "hc head"),
    (r"^hc_", "hyper-connections"),
    (r"^(attn_norm|ffn_norm|input_layernorm|post_attention_layernorm)\.", "norms"),
    (r"^(main_proj|fc|e_proj|h_proj)\.", "main_proj"),
    (r"^(main_norm|hidden_norm|enorm|hnorm)\.", "main_norm"),
    (r"^norm\.", "final norm"),
    (r"^markov_head\.", "markov head"),
    (r"^confidence_head\.", "confidence head"),
    (r"^(embed|embed_tokens)\.", "embedding (target's)"),
    (r"^(head|lm_head)\.", "lm head (target's)"),
)


def component_of(name: str) -> str:
    """'mtp.1.attn.wq_a.weight' -> 'stage 1 / attention'; 'layers.0.mlp.up_proj.weight' -> 'layer 0 / mlp'."""
    prefix, rest = "", name
    m = re.match(r"^(mtp|layers)\.(\d+)\.(.*)$", name)
    if m:
        prefix, rest = f"{'stage' if m.group(1) == 'mtp' else 'layer'} {m.group(2)} / ", m.group(3)
    for pattern, comp in _RULES:
        if re.match(pattern, rest):
            return prefix + comp
    return prefix + "other"


@dataclass
class Component:
    name: str
    tensors: int = 0
    params: int = 0  # logical parameters (FP4: two per byte)
    nbytes: int = 0  # bytes on disk, scales included
    dtypes: set[str] = field(default_factory=set)
    quant: set[str] = field(default_factory=set)  # e.g. "fp8 e4m3 32x32", "fp4 e2m1 /32"

    def as_dict(self) -> dict:
        return {"component": self.name, "tensors": self.tensors, "params": self.params, "bytes": self.nbytes,
                "dtypes": sorted(self.dtypes), "quant": sorted(self.quant) or ["none"]}


def component_table(ckpt: Checkpoint, names: list[str], block: tuple[int, int]) -> list[Component]:
    """Components of `names` in first-seen order (stages in order)."""
    comps: dict[str, Component] = {}
    for name in sorted(names, key=_natural):
        info = ckpt.tensor(name)
        c = comps.setdefault(component_of(name), Component(component_of(name)))
        c.tensors += 1
        c.nbytes += info.nbytes
        c.dtypes.add(info.dtype)
        is_scale = name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in ckpt.weight_map
        if is_scale:
            continue
        kind = quant_kind(info) if scale_name(name) in ckpt.weight_map else None
        n = 1
        for dim in logical_shape(kind, info.shape):
            n *= dim
        c.params += n
        if kind == "fp8":
            c.quant.add(f"fp8 e4m3 x e8m0 {block[0]}x{block[1]}")
        elif kind == "fp4":
            c.quant.add("fp4 e2m1 x e8m0 /32")
    return list(comps.values())


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
