"""Dequantize DeepSeek-V4 weights to bf16.

- FP8: `F8_E4M3` weight `[n, k]` × `F8_E8M0` scale `[ceil(n/bn), ceil(k/bk)]`, one power-of-two
  scale per bn×bk block; edge blocks are partial.
- FP4: e2m1 codes packed two per `I8` byte, weight `[n, k/2]`, scale `[n, ceil(k/32)]` (32 inputs
  share one scale). Element 2j is the LOW nibble of byte j, element 2j+1 the HIGH nibble
  (OCP MXFP4 order; confirmed against a public DeepSeek-V4 DSpark dequantizer, which looks up
  `byte & 0x0F` first and `byte >> 4` second). Sign is bit 3 of the nibble.
- e8m0 scale byte e means 2^(e-127); e = 255 is NaN and is an error here.

Products are exact in float32 (4-bit significand × power of two), so the only rounding is the
final float32 -> bf16 (round to nearest even), which makes the result reproducible bit for bit.
"""

from __future__ import annotations

import torch

from dsparkctl.checkpoint.source import FP4_BLOCK
from dsparkctl.errors import CheckpointError

# e2m1 code -> value; codes 8..15 are the negatives (8 is -0.0).
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


def e8m0_to_float(scale: torch.Tensor, name: str) -> torch.Tensor:
    """Scale bytes (uint8 or float8_e8m0fnu) -> float32 2^(e-127); NaN (255) raises."""
    raw = scale.view(torch.uint8)
    if bool((raw == 255).any()):
        raise CheckpointError(f"tensor {name}: scale holds e8m0 NaN (0xFF)",
                              hint="the checkpoint's scales are corrupt; re-download the shard")
    return raw.view(torch.float8_e8m0fnu).to(torch.float32)


def _check_scale(name: str, scale: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(scale.shape) != expected:
        raise CheckpointError(f"tensor {name}: scale shape {tuple(scale.shape)} != expected {expected}",
                              hint="the block size in quantization_config does not match the weights")


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str = "?") -> torch.Tensor:
    """weight [n, k] float8_e4m3fn, scale [ceil(n/bn), ceil(k/bk)] -> bf16 [n, k]."""
    n, k = weight.shape
    bn, bk = block
    sn, sk = -(-n // bn), -(-k // bk)
    _check_scale(name, scale, (sn, sk))
    s = e8m0_to_float(scale, name)  # [sn, sk]
    w = weight.view(torch.float8_e4m3fn).to(torch.float32)  # [n, k]
    if n % bn or k % bk:  # pad edges to whole blocks, then cut back
        w = torch.nn.functional.pad(w, (0, sk * bk - k, 0, sn * bn - n))
    w = w.view(sn, bn, sk, bk).mul_(s.view(sn, 1, sk, 1))
    return w.view(sn * bn, sk * bk)[:n, :k].to(torch.bfloat16)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] int8 -> [n, k] float32 e2m1 values (low nibble first)."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1)  # [n, k/2, 2]
    return FP4_VALUES[codes.long()].view(b.shape[0], b.shape[1] * 2)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, name: str = "?") -> torch.Tensor:
    """packed [n, k/2] int8, scale [n, ceil(k/32)] e8m0 -> bf16 [n, k]."""
    n, half = packed.shape
    k = half * 2
    sk = -(-k // FP4_BLOCK)
    _check_scale(name, scale, (n, sk))
    s = e8m0_to_float(scale, name)  # [n, sk]
    w = unpack_fp4(packed)  # [n, k]
    if k % FP4_BLOCK:
        w = torch.nn.functional.pad(w, (0, sk * FP4_BLOCK - k))
    w = w.view(n, sk, FP4_BLOCK).mul_(s.view(n, sk, 1))
    return w.view(n, sk * FP4_BLOCK)[:, :k].to(torch.bfloat16)
