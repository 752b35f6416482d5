"""Miniature checkpoints with the real tensor names, dtypes, sharding and index layout.

Shared by the tests and `benchmarks/bench_extract.py`. Dimensions are small (or whatever `Dims`
says); names, dtypes, stage counts per docs/formats.md §1–3 are exact. Tensor bytes are random,
except e8m0 scales, which are kept finite (no 0xFF) so the checkpoint dequantizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dsparkctl.checkpoint.safetensors_io import DTYPE_SIZE, encode_header
from dsparkctl.checkpoint.source import INDEX, SINGLE

Spec = tuple[str, str, tuple[int, ...]]  # (name, dtype, stored shape)


@dataclass(frozen=True)
class Dims:
    hidden: int = 64  # V4.1: 5120
    vocab: int = 512  # 129280
    layers: int = 4  # target decoder layers (V4.1: 40)
    q_lora: int = 40  # wq_a out (1280); not a multiple of 32: exercises edge blocks
    q_out: int = 128  # wq_b out (32768)
    kv: int = 48  # wkv out (512)
    wo_a: tuple[int, int] = (64, 64)  # (8192, 4096)
    experts: int = 8  # draft routed experts (V4.1: 128, 0731: 256)
    moe_inter: int = 32  # routed expert width (2304)
    shared_inter: int = 32  # shared expert width (2304)
    rank: int = 16  # Markov rank (256)
    hc: int = 4  # hyper-connection multiplier
    sink: int = 8  # attention sinks (64 heads)
    target_experts: int = 2  # routed experts per target layer in the miniature


def _fp8(name: str, n: int, k: int, b: int) -> list[Spec]:
    return [(f"{name}.weight", "F8_E4M3", (n, k)), (f"{name}.scale", "F8_E8M0", (-(-n // b), -(-k // b)))]


def _fp4(name: str, n: int, k: int) -> list[Spec]:
    return [(f"{name}.weight", "I8", (n, k // 2)), (f"{name}.scale", "F8_E8M0", (n, -(-k // 32)))]


def _block(p: str, d: Dims, b: int, experts: int) -> list[Spec]:
    """One V4 transformer block (a target layer or an MTP stage) under prefix `p`."""
    h, hc = d.hidden, d.hc
    s: list[Spec] = []
    s += _fp8(f"{p}attn.wq_a", d.q_lora, h, b) + [(f"{p}attn.q_norm.weight", "BF16", (d.q_lora,))]
    s += _fp8(f"{p}attn.wq_b", d.q_out, d.q_lora, b)
    s += _fp8(f"{p}attn.wkv", d.kv, h, b) + [(f"{p}attn.kv_norm.weight", "BF16", (d.kv,))]
    s += _fp8(f"{p}attn.wo_a", d.wo_a[0], d.wo_a[1], b) + _fp8(f"{p}attn.wo_b", h, d.wo_a[0], b)
    s += [(f"{p}attn.attn_sink", "F32", (d.sink,))]
    s += [(f"{p}attn_norm.weight", "BF16", (h,)), (f"{p}ffn_norm.weight", "BF16", (h,))]
    for kind in ("attn", "ffn"):
        s += [(f"{p}hc_{kind}_fn", "F32", ((2 + hc) * hc, hc * h)), (f"{p}hc_{kind}_base", "F32", ((2 + hc) * hc,)),
              (f"{p}hc_{kind}_scale", "F32", (3,))]
    s += [(f"{p}ffn.gate.weight", "BF16", (experts, h)), (f"{p}ffn.gate.bias", "F32", (experts,)),
          (f"{p}ffn.gate.bias_vl", "F32", (experts,))]
    s += _fp8(f"{p}ffn.shared_experts.w1", d.shared_inter, h, b) + _fp8(f"{p}ffn.shared_experts.w2", h, d.shared_inter, b)
    s += _fp8(f"{p}ffn.shared_experts.w3", d.shared_inter, h, b)
    for e in range(experts):
        s += _fp4(f"{p}ffn.experts.{e}.w1", d.moe_inter, h) + _fp4(f"{p}ffn.experts.{e}.w2", h, d.moe_inter)
        s += _fp4(f"{p}ffn.experts.{e}.w3", d.moe_inter, h)
    return s


def _target(d: Dims, b: int) -> list[list[Spec]]:
    """Target tensors as one list per target shard: embed + a layer each, head/norm with the last."""
    shards = [[("embed.weight", "BF16", (d.vocab, d.hidden))]] + [[] for _ in range(d.layers - 1)]
    for i in range(d.layers):
        shards[i] += _block(f"layers.{i}.", d, b, d.target_experts)
    shards[-1] += [("norm.weight", "BF16", (d.hidden,)), ("head.weight", "BF16", (d.vocab, d.hidden))]
    return shards


def v41_stages(d: Dims, b: int = 32) -> list[list[Spec]]:
    """The three V4.1-Flash DSpark stages (801 / 798 / 802 tensors at 128 experts)."""
    h, r = d.hidden, d.rank
    s0 = _fp8("mtp.0.main_proj", h, 3 * h, b) + [("mtp.0.main_norm.weight", "BF16", (h,))] + _block("mtp.0.", d, b, d.experts)
    s1 = _block("mtp.1.", d, b, d.experts)
    s2 = _block("mtp.2.", d, b, d.experts) + [
        ("mtp.2.norm.weight", "BF16", (h,)),
        ("mtp.2.markov_head.embed.weight", "BF16", (d.vocab, r)),
        ("mtp.2.markov_head.head.weight", "BF16", (d.vocab, r)),
        ("mtp.2.confidence_head.proj.weight", "BF16", (1, h + r))]
    return [s0, s1, s2]


def v0731_stages(d: Dims, b: int = 128) -> list[list[Spec]]:
    h, r, hc = d.hidden, d.rank, d.hc
    s0 = _fp8("mtp.0.main_proj", h, 3 * h, b) + [("mtp.0.main_norm.weight", "BF16", (h,))] + _block("mtp.0.", d, b, d.experts)
    s1 = _block("mtp.1.", d, b, d.experts)
    s2 = _block("mtp.2.", d, b, d.experts) + [
        ("mtp.2.norm.weight", "BF16", (h,)),
        ("mtp.2.hc_head_fn", "F32", (hc, hc * h)), ("mtp.2.hc_head_base", "F32", (hc,)),
        ("mtp.2.hc_head_scale", "F32", (1,)),
        ("mtp.2.markov_head.markov_w1.weight", "BF16", (d.vocab, r)),
        ("mtp.2.markov_head.markov_w2.weight", "BF16", (d.vocab, r)),
        ("mtp.2.confidence_head.proj.weight", "BF16", (1, h + r))]
    return [s0, s1, s2]


def preview_stages(d: Dims, b: int = 128) -> list[list[Spec]]:
    h = d.hidden
    s0 = (_fp8("mtp.0.e_proj", h, h, b) + _fp8("mtp.0.h_proj", h, h, b)
          + [("mtp.0.enorm.weight", "BF16", (h,)), ("mtp.0.hnorm.weight", "BF16", (h,))]
          + _block("mtp.0.", d, b, d.experts) + [("mtp.0.norm.weight", "BF16", (h,))])
    return [s0]


def deepspec_specs(d: Dims, markov: bool, n_layers: int = 2, taps: int = 5) -> list[Spec]:
    h, v, r = d.hidden, d.vocab, d.rank
    s: list[Spec] = [("embed_tokens.weight", "BF16", (v, h)), ("lm_head.weight", "BF16", (v, h))]
    for i in range(n_layers):
        p = f"layers.{i}."
        s += [(f"{p}self_attn.{x}_proj.weight", "BF16", (h, h)) for x in "qkvo"]
        s += [(f"{p}self_attn.{x}_norm.weight", "BF16", (16,)) for x in "qk"]
        s += [(f"{p}mlp.{x}_proj.weight", "BF16", (2 * h, h) if x != "down" else (h, 2 * h)) for x in ("gate", "up", "down")]
        s += [(f"{p}{x}_layernorm.weight", "BF16", (h,)) for x in ("input", "post_attention")]
    s += [("norm.weight", "BF16", (h,)), ("fc.weight", "BF16", (h, taps * h)), ("hidden_norm.weight", "BF16", (h,))]
    if markov:
        s += [("markov_head.markov_w1.weight", "BF16", (v, r)), ("markov_head.markov_w2.weight", "BF16", (v, r)),
              ("confidence_head.proj.weight", "BF16", (1, h + r)), ("confidence_head.proj.bias", "BF16", (1,))]
    return s


def _config(layout: str, d: Dims) -> dict:
    if layout == "v4.1-flash":
        return {"architectures": ["DeepseekV41ForConditionalGeneration"], "model_type": "deepseek_v41",
                "text_config": {"hidden_size": d.hidden, "num_hidden_layers": d.layers, "vocab_size": d.vocab,
                                "n_routed_experts": 3 * d.experts, "num_experts_per_tok": 6,
                                "num_nextn_predict_layers": 3, "dspark_block_size": 5,
                                "dspark_noise_token_id": d.vocab - 3,
                                "dspark_target_layer_ids": list(range(d.layers - 3, d.layers)),
                                "dspark_markov_rank": d.rank, "dspark_n_routed_experts": d.experts,
                                "dspark_num_experts_per_tok": 3, "sliding_window": 128, "hc_mult": d.hc},
                "quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                                        "expert_dtype": "fp4"},
                "torch_dtype": "bfloat16"}
    if layout in ("v4-flash-dspark-0731", "v4-preview-mtp"):
        cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": d.hidden,
               "num_hidden_layers": d.layers, "vocab_size": d.vocab, "n_routed_experts": d.experts,
               "num_experts_per_tok": 6, "num_nextn_predict_layers": 1, "hc_mult": d.hc,
               "quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0",
                                       "weight_block_size": [128, 128]}, "torch_dtype": "bfloat16"}
        if layout == "v4-flash-dspark-0731":
            cfg |= {"dspark_block_size": 5, "dspark_noise_token_id": d.vocab - 3,
                    "dspark_target_layer_ids": list(range(d.layers - 3, d.layers)), "dspark_markov_rank": d.rank}
        return cfg
    markov = layout == "deepspec-dspark"
    return {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": d.hidden,
            "vocab_size": d.vocab, "num_hidden_layers": 2, "num_target_layers": 36, "block_size": 7,
            "mask_token_id": d.vocab - 2, "target_layer_ids": [1, 9, 17, 25, 33],
            "markov_rank": d.rank if markov else 0, "markov_head_type": "vanilla",
            "enable_confidence_head": markov, "confidence_head_with_markov": markov, "torch_dtype": "bfloat16"}


def shard_plan(layout: str, d: Dims) -> list[list[Spec]]:
    """Tensors per shard, in the real layouts' order: target first, draft near the end."""
    if layout == "v4.1-flash":  # draft in shards 5-7 of 8, head in 4 (like 44-46 of 48, head in 43)
        target = _target(d, 32)
        tail = [s for s in target[-1] if ".ffn.experts." in s[0]]
        target[-1] = [s for s in target[-1] if s not in tail]
        return target + v41_stages(d) + [tail]
    if layout == "v4-flash-dspark-0731":  # mtp.0/1/2 in the last three shards
        return _target(d, 128) + v0731_stages(d)
    if layout == "v4-preview-mtp":
        return _target(d, 128) + preview_stages(d)
    if layout in ("deepspec-dspark", "deepspec-dflash"):
        return [deepspec_specs(d, markov=layout == "deepspec-dspark")]
    raise ValueError(f"no fixture for layout {layout!r}")


FIXTURE_LAYOUTS = ("v4.1-flash", "v4-flash-dspark-0731", "v4-preview-mtp", "deepspec-dspark", "deepspec-dflash")


def write_fixture(folder: Path, layout: str = "v4.1-flash", dims: Dims | None = None, seed: int = 0) -> Path:
    """Write a miniature checkpoint of `layout` into `folder` (created) and return it."""
    d = dims or Dims()
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    plan = shard_plan(layout, d)
    single = layout.startswith("deepspec")
    names = [SINGLE] if single else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map, total = {}, 0
    for file, specs in zip(names, plan):
        entries = [(n, dt, sh, int(np.prod(sh, dtype=np.int64)) * DTYPE_SIZE[dt]) for n, dt, sh in specs]
        with open(folder / file, "wb") as fh:
            fh.write(encode_header(entries, {"format": "pt"}))
            for _n, dt, _sh, nbytes in entries:
                fh.write(_random_bytes(rng, dt, nbytes))
        weight_map |= {n: file for n, *_ in specs}
        total += sum(e[3] for e in entries)
    (folder / "config.json").write_text(json.dumps(_config(layout, d), indent=2))
    if not single:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    return folder


def _random_bytes(rng: np.random.Generator, dtype: str, nbytes: int) -> bytes:
    if dtype == "F8_E8M0":  # finite power-of-two scales around 1
        return rng.integers(118, 136, size=nbytes, dtype=np.uint8).tobytes()
    if dtype in ("BF16", "F32"):  # finite small floats, not random bit patterns
        vals = rng.standard_normal(nbytes // DTYPE_SIZE[dtype], dtype=np.float32) * 0.02
        if dtype == "F32":
            return vals.tobytes()
        return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return rng.bytes(nbytes)


def bench_dims() -> Dims:
    """About 1.3 GB of draft shards (V4.1 layout) for benchmarks/bench_extract.py."""
    return replace(Dims(), hidden=2048, vocab=32768, q_lora=512, q_out=4096, kv=512, wo_a=(2048, 1024),
                   experts=128, moe_inter=1024, shared_inter=1024, rank=256, sink=64, layers=4, target_experts=2)
