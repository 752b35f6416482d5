"""A draft's linears in int8 on CPU: a quarter of the bytes a round reads, verification unchanged.

At one request a round's draft is bound by reading its weights (two layers and an 8,192-row head:
about 50 MB in fp32). torch's dynamic-quantized linear (int8 weights, one scale per output row;
each call quantizes its input with one scale and accumulates in int32) reads a quarter of that,
and for the draft's 1-8 row products on this machine's CPU it ran 3-4x faster than the packed
fp32 kernel (`benchmarks/bench_int8_draft.py`).

Lossless by construction: only the DRAFT changes, and verification accepts or rejects whatever it
proposes against the fp32 target (greedy identity and the chi-square tests run on an int8 draft in
tests/test_int8_draft.py). What can change is how often drafts are accepted. The draft's `fc`,
which projects the target's tapped hidden states (four normalised taps side by side) into the draft,
stays in fp32: its input is the one whose spread one input scale cannot cover. Measured on the
shipped draft, quantizing it too cost 2% of τ; with it in fp32, τ was unchanged.

Inference only (no autograd). The fp32 `weight` stays reachable: drafts read its dtype, and the
fused q/k/v and gate/up copies are built from it (models/draft_layers.py `fuse_linears`).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from dsparkctl.models.packed_linear import PackedLinear, swap_modules

DRAFT_WEIGHTS = ("auto", "fp32", "int8")
KEEP_FP32 = ("fc",)  # the draft's own attributes whose linears stay fp32 (see the module doc)


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W in int8 (symmetric, one scale per output row), x quantized per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w = weight.detach().to(torch.float32)
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.float64)
        with warnings.catch_warnings():  # torch marks its quantized tensor factories as deprecated
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros(self.out_features, dtype=torch.long), 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features).contiguous(), self._packed, False)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


_CHECKED: bool | None = None


def int8_supported() -> bool:
    """This torch has the quantized int8 linear ops for the CPU and they agree with fp32 on a small
    random case (within int8's error: 3% of the output's scale); checked once per process."""
    global _CHECKED
    if _CHECKED is None:
        try:
            g = torch.Generator().manual_seed(0)
            w, b, x = torch.randn(40, 48, generator=g), torch.randn(40, generator=g), torch.randn(3, 48, generator=g)
            ref = x @ w.T + b
            err = (Int8Linear(w, b)(x) - ref).abs().max() / ref.abs().max()
            _CHECKED = bool(err < 0.03)
        except (RuntimeError, AttributeError, NotImplementedError):
            _CHECKED = False
    return _CHECKED


def can_quantize(draft: nn.Module) -> bool:
    """Whether `draft`'s linears can run in int8 here: on the CPU, in fp32, with working ops."""
    p = next(draft.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.float32 and int8_supported()


def quantize_draft(draft: nn.Module) -> int:
    """Replace the draft's linears (packed or stock; all but `KEEP_FP32` and one-output heads) by
    Int8Linear, in place; returns how many. Shared modules stay shared (a borrowed LM head is
    replaced in the draft only: the target keeps its own)."""
    kept = {id(getattr(draft, name)) for name in KEEP_FP32 if getattr(draft, name, None) is not None}

    def swap(child: nn.Module) -> nn.Module | None:
        if (type(child) not in (nn.Linear, PackedLinear) or id(child) in kept or child.out_features < 2
                or getattr(child, "weight", None) is None):
            return None
        return Int8Linear(child.weight, child.bias)
    n = swap_modules(draft, swap)
    for m in draft.modules():
        if hasattr(m, "drop_inference_caches"):
            m.drop_inference_caches()  # fused copies are rebuilt from the int8 parts
    return n
