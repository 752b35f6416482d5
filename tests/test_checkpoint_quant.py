"""Dequantization against an independent plain-Python reference (bit manipulation, no torch math)."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from dsparkctl.checkpoint.quant import dequant_fp4, dequant_fp8
from dsparkctl.errors import CheckpointError


# ---- the reference: pure Python on integers ---------------------------------------------------
def ref_e2m1(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * mag


def ref_e4m3(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    mag = (man / 8) * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return sign * mag


def ref_bf16_bits(x: float) -> int:
    """Round a double to bf16 (nearest, ties to even); exact inputs here, so one rounding."""
    if math.isnan(x):
        return 0x7FC0
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a == 0:
        return sign
    _, e = math.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    quantum = 2.0 ** max(e - 1 - 7, -133)  # 7 fraction bits; subnormal spacing 2^-133
    q = a / quantum
    n = math.floor(q)
    if q - n > 0.5 or (q - n == 0.5 and n % 2):
        n += 1
    r = n * quantum
    if r >= 2.0 ** 128:
        return sign | 0x7F80
    return sign | (struct.unpack(">I", struct.pack(">f", r))[0] >> 16)


def ref_fp8(codes: list[list[int]], scales: list[list[int]], block: tuple[int, int]) -> list[list[int]]:
    return [[ref_bf16_bits(ref_e4m3(c) * 2.0 ** (scales[i // block[0]][j // block[1]] - 127))
             for j, c in enumerate(row)] for i, row in enumerate(codes)]


def ref_fp4(packed: list[list[int]], scales: list[list[int]]) -> list[list[int]]:
    out = []
    for i, row in enumerate(packed):
        vals = []
        for byte in row:
            vals += [ref_e2m1(byte & 0xF), ref_e2m1(byte >> 4)]  # even index = low nibble
        out.append([ref_bf16_bits(v * 2.0 ** (scales[i][j // 32] - 127)) for j, v in enumerate(vals)])
    return out


# ---- helpers -----------------------------------------------------------------------------------
def u8(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8)


def bits(t: torch.Tensor) -> list[list[int]]:
    return (t.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


def same(got: list[list[int]], want: list[list[int]]) -> bool:
    nan = lambda b: (b & 0x7F80) == 0x7F80 and (b & 0x7F)  # noqa: E731
    return all((g == w) or (nan(g) and nan(w)) for gr, wr in zip(got, want) for g, w in zip(gr, wr))


# ---- pinned hand-computed values ----------------------------------------------------------------
@pytest.mark.parametrize("byte,scale,expected", [
    (0x21, 127, [0.5, 1.0]),  # low nibble 1 -> 0.5 is element 0, high nibble 2 -> 1.0 element 1
    (0x7F, 127, [-6.0, 6.0]),
    (0x98, 127, [-0.0, -0.5]),
    (0x53, 128, [3.0, 6.0]),  # 1.5*2, 3*2
    (0x44, 126, [1.0, 1.0]),  # 2 * 0.5
])
def test_fp4_hand_values(byte, scale, expected):
    row = [byte] + [0] * 15
    out = dequant_fp4(u8([row]).view(torch.int8), u8([[scale]]).view(torch.float8_e8m0fnu))
    assert out[0, :2].tolist() == expected
    assert math.copysign(1, out[0, 0].item()) == math.copysign(1, expected[0])


def test_fp4_table_matches_e2m1_magnitudes():
    assert [ref_e2m1(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert [ref_e2m1(c) for c in range(8, 16)] == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


@pytest.mark.parametrize("scale", [0, 1, 126, 127, 128, 200, 254])
def test_fp4_all_codes_all_positions(scale):
    packed = [[lo | (hi << 4) for hi in range(16) for lo in range(16)][i * 16:(i + 1) * 16] for i in range(16)]
    scales = [[scale]] * 16
    got = dequant_fp4(u8(packed).view(torch.int8), u8(scales).view(torch.float8_e8m0fnu))
    assert bits(got) == ref_fp4(packed, scales)


@pytest.mark.parametrize("scale", [0, 1, 120, 127, 135, 254])
def test_fp8_all_codes(scale):
    codes = [list(range(r * 16, r * 16 + 16)) for r in range(16)]  # all 256 e4m3 codes
    got = dequant_fp8(u8(codes).view(torch.float8_e4m3fn), u8([[scale]]).view(torch.float8_e8m0fnu), (32, 32))
    assert same(bits(got), ref_fp8(codes, [[scale]], (32, 32)))


@pytest.mark.parametrize("n,k,block", [(70, 45, (32, 32)), (33, 129, (128, 128)), (32, 64, (32, 32)), (1, 1, (32, 32))])
def test_fp8_random_with_edge_blocks(n, k, block):
    rnd = random.Random(n * 1000 + k)
    codes = [[rnd.randrange(256) for _ in range(k)] for _ in range(n)]
    sn, sk = -(-n // block[0]), -(-k // block[1])
    scales = [[rnd.choice([0, 1, 254, rnd.randrange(255)]) for _ in range(sk)] for _ in range(sn)]
    got = dequant_fp8(u8(codes).view(torch.float8_e4m3fn), u8(scales).view(torch.float8_e8m0fnu), block)
    assert tuple(got.shape) == (n, k) and got.dtype == torch.bfloat16
    assert same(bits(got), ref_fp8(codes, scales, block))


@pytest.mark.parametrize("n,half", [(5, 40), (3, 16), (2, 7), (64, 32)])
def test_fp4_random_with_edge_blocks(n, half):
    rnd = random.Random(n * 100 + half)
    packed = [[rnd.randrange(256) for _ in range(half)] for _ in range(n)]
    sk = -(-(2 * half) // 32)
    scales = [[rnd.choice([0, 1, 254, rnd.randrange(255)]) for _ in range(sk)] for _ in range(n)]
    got = dequant_fp4(u8(packed).view(torch.int8), u8(scales).view(torch.float8_e8m0fnu))
    assert tuple(got.shape) == (n, 2 * half)
    assert bits(got) == ref_fp4(packed, scales)


def test_nan_scale_is_an_error():
    with pytest.raises(CheckpointError, match="NaN"):
        dequant_fp8(u8([[1]]).view(torch.float8_e4m3fn), u8([[255]]).view(torch.float8_e8m0fnu), (32, 32), "w")
    with pytest.raises(CheckpointError, match="layers.0.x.weight"):
        dequant_fp4(u8([[1]]).view(torch.int8), u8([[255]]).view(torch.float8_e8m0fnu), "layers.0.x.weight")


def test_wrong_scale_shape_is_an_error():
    with pytest.raises(CheckpointError, match="scale shape"):
        dequant_fp8(u8([[1] * 64] * 64).view(torch.float8_e4m3fn), u8([[127]]).view(torch.float8_e8m0fnu), (32, 32))
