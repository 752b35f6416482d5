"""Inference on CPU with pre-packed linear weights (oneDNN), for target and draft alike: the
`nn.Module` work only (which route is faster on this machine is chosen in engine/kernel_choice.py).

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

A `Route` says how a model's linears run: all stock (nothing packed), all packed, or routed by a
call's row count (stock up to N rows, packed above; both copies of each weight kept).
`apply_route` brings a model's linears to a route and drops the copies it never reads.

Inference only: `PackedLinear` has no autograd, so training never packs (its draft backpropagates
through the target's borrowed LM head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

ROWS_HINT = 8  # oneDNN packs for an expected row count; ≥ γ+1 of usual drafts, fine for 1 row too


@dataclass(frozen=True)
class Route:
    """How a model's linears run: `packed=False`: torch's stock kernels, nothing packed; else the
    packed kernel, except calls of at most `stock_rows` rows, which take the stock kernel (0: none)."""

    packed: bool = False
    stock_rows: int = 0

    def __post_init__(self) -> None:
        if self.stock_rows < 0 or (self.stock_rows and not self.packed):
            raise ValueError(f"not a route: {self}")

    @property
    def label(self) -> str:
        """For reports and JSON: stock, packed, or stock<=N,packed."""
        if not self.packed:
            return "stock"
        return f"stock<={self.stock_rows},packed" if self.stock_rows else "packed"


STOCK, PACKED = Route(), Route(packed=True)
EVERY_CALL = math.inf  # a PackedLinear's stock_rows that sends every call to the stock kernel


class PackedLinear(nn.Module):
    """nn.Linear for inference: y = x Wᵀ + b with W packed once for oneDNN.

    `weight` stays reachable when asked (`keep_weight`: tied or borrowed weights, where it costs
    no memory, and small drafts that read `.weight.dtype`); otherwise only the packed copy lives.
    `stock_rows`: calls with at most this many rows take torch's stock kernel on `weight` instead
    (set by `use_stock_up_to`; 0 = always packed, EVERY_CALL = never)."""

    stock_rows: float = 0

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
        if self.stock_rows and (x.numel() // self.in_features) <= self.stock_rows:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"stock_rows={self.stock_rows}")


def packing_supported(module: nn.Module) -> bool:
    """True when this torch has the oneDNN linear ops and the module's linears are fp32 on CPU."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    lins = [m for m in module.modules() if type(m) is nn.Linear]
    if not lins:
        return False
    return all(m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in lins)


def pack_linears(module: nn.Module, keep_weight: bool = False, keep: tuple[nn.Module, ...] = (),
                 routing: bool = False) -> int:
    """Replace every plain nn.Linear under `module` by a PackedLinear, in place; returns how many.

    `keep`: linears whose weight must stay reachable (e.g. an LM head tied to the embedding, which
    a draft borrows). A linear reached twice (shared) is packed once and stays shared. Nothing is
    replaced unless `packing_supported(module)`; a kernel that fails its self-check leaves the
    module untouched. `routing`: keep every weight too, so calls can be routed to the stock kernel
    by row count (`use_stock_up_to`; a routed `Route`)."""
    if not packing_supported(module) or not _self_check():
        return 0
    keep_ids = {id(m) for m in keep}

    def pack(child: nn.Module) -> nn.Module | None:
        if type(child) is not nn.Linear:
            return None
        kept = keep_weight or id(child) in keep_ids
        packed = PackedLinear(child, kept or routing).train(child.training)
        packed._weight_for_routing_only = routing and not kept
        return packed
    return swap_modules(module, pack)


def swap_modules(module: nn.Module, replace: Callable[[nn.Module], nn.Module | None]) -> int:
    """Replace, in place, every submodule of `module` for which `replace` returns a module; returns
    how many distinct ones were replaced. A module reached twice (shared) is replaced once and
    stays shared."""
    done: dict[int, nn.Module] = {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in done:
                new = replace(child)
                if new is None:
                    continue
                done[id(child)] = new
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


def unpack_linears(module: nn.Module) -> int:
    """Turn every PackedLinear under `module` back into an nn.Linear on its kept weight (which it
    must have); returns how many. Shared layers stay shared."""
    def unpack(child: nn.Module) -> nn.Module | None:
        if not isinstance(child, PackedLinear):
            return None
        lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
        lin.weight = child.weight
        if child.bias is not None:
            lin.bias = nn.Parameter(child.bias, requires_grad=False)
        return lin.train(child.training)
    return swap_modules(module, unpack)


def route_of(model: nn.Module) -> Route:
    """The route a model's linears take now (STOCK when none is packed)."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            return STOCK if m.stock_rows == EVERY_CALL else Route(packed=True, stock_rows=int(m.stock_rows))
    return STOCK


def use_stock_up_to(module: nn.Module, rows: float, free: bool = False) -> None:
    """Route every PackedLinear under `module` to the stock kernel for calls of ≤ `rows` rows.
    `free`: drop the copy this routing never reads (the packed one when `rows` is EVERY_CALL, the
    stock one when `rows` is 0 and the weight was only kept for routing)."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            if rows and not hasattr(m, "weight"):
                raise ValueError("a stock route needs the layer's weight (pack with keep_weight=True)")
            m.stock_rows = rows
            if free and rows == EVERY_CALL:
                m.packed = torch.empty(0)
            elif free and rows == 0 and getattr(m, "_weight_for_routing_only", False):
                del m.weight


def apply_route(model: nn.Module, route: Route, keep: tuple[nn.Module, ...] = ()) -> Route:
    """Bring a model's linears to `route`, from stock or from packed-with-both-copies, dropping the
    copies it never reads; returns the route reached (STOCK where this torch's packed kernel failed
    its self-check). `keep`: as in pack_linears."""
    if not route.packed:
        unpack_linears(model)
        return STOCK
    if not any(isinstance(m, PackedLinear) for m in model.modules()):
        if not pack_linears(model, keep=keep, routing=route.stock_rows > 0):
            return STOCK
    use_stock_up_to(model, route.stock_rows, free=True)
    return route


def pack_like(draft: nn.Module, route: Route) -> None:
    """Pack a (small) draft's own linears to follow the target's route (borrowed ones already do);
    its weights stay reachable (drafts read `.weight.dtype`)."""
    if route.packed and pack_linears(draft, keep_weight=True):
        use_stock_up_to(draft, route.stock_rows)
