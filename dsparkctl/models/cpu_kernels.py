"""Inference on CPU with pre-packed linear weights (oneDNN), for target and draft alike.

Why: with stock kernels a target forward over the 2–8 tokens of a verification costs far more
than a one-token decode step on small CPUs (torch calls MKL's GEMV for one row and GEMM for
several; the GEMM repacks the weight at every call). A speculative round is one such forward, so
that repacking alone decided whether speculation could win. oneDNN's linear with a weight packed
once at load time costs about the same for 1 and 8 rows and is faster for both (measured in
`benchmarks/bench_cpu_kernels.py`, results in docs/generate.md).

Exactness: the packed product is the same fp32 arithmetic in another summation order, like any
other kernel choice torch makes by shape. Plain and speculative decoding share the packed model,
so greedy identity holds exactly as before (tests/test_cpu_kernels.py runs the identity and χ²
tests on a packed pair).

Inference only: `PackedLinear` has no autograd, so training never packs (its draft backpropagates
through the target's borrowed LM head).
"""

from __future__ import annotations

import torch
from torch import nn

ROWS_HINT = 8  # oneDNN packs for an expected row count; ≥ γ+1 of usual drafts, fine for 1 row too


class PackedLinear(nn.Module):
    """nn.Linear for inference: y = x Wᵀ + b with W packed once for oneDNN.

    `weight` stays reachable when asked (`keep_weight`: tied or borrowed weights, where it costs
    no memory, and small drafts that read `.weight.dtype`); otherwise only the packed copy lives."""

    def __init__(self, linear: nn.Linear, keep_weight: bool):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)
        if keep_weight:
            self.weight = linear.weight  # the same Parameter: shared, not copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_supported(module: nn.Module) -> bool:
    """True when this torch has the oneDNN linear ops and the module's linears are fp32 on CPU."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    lins = [m for m in module.modules() if type(m) is nn.Linear]
    if not lins:
        return False
    return all(m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in lins)


def pack_linears(module: nn.Module, keep_weight: bool = False, keep: tuple[nn.Module, ...] = ()) -> int:
    """Replace every plain nn.Linear under `module` by a PackedLinear, in place; returns how many.

    `keep`: linears whose weight must stay reachable (e.g. an LM head tied to the embedding, which
    a draft borrows). A linear reached twice (shared) is packed once and stays shared. Nothing is
    replaced unless `packing_supported(module)`; a kernel that fails its self-check leaves the
    module untouched."""
    if not packing_supported(module) or not _self_check():
        return 0
    keep_ids = {id(m) for m in keep}
    done: dict[int, PackedLinear] = {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if id(child) not in done:
                done[id(child)] = PackedLinear(child, keep_weight or id(child) in keep_ids)
            setattr(parent, name, done[id(child)])
    return len(done)


_CHECKED: bool | None = None


def _self_check() -> bool:
    """The packed kernel agrees with nn.functional.linear on a small random case (once per process)."""
    global _CHECKED
    if _CHECKED is None:
        try:
            g = torch.Generator().manual_seed(0)
            lin = nn.Linear(48, 40, bias=True)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(40, 48, generator=g))
                lin.bias.copy_(torch.randn(40, generator=g))
                x = torch.randn(2, 3, 48, generator=g)
                _CHECKED = bool(torch.allclose(PackedLinear(lin, False)(x), lin(x), rtol=1e-4, atol=1e-4))
        except (RuntimeError, AttributeError):
            _CHECKED = False
    return _CHECKED
