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

Which kernel wins depends on the CPU: on one 2-core machine the packed kernel won at every row
count (1.04× at one row, 1.4–1.8× at 2–8); on another (an AMX-capable Xeon) torch's stock kernels
were 1.2× faster up to 3 rows and the packed ones 1.06× faster from 4 rows on. `--cpu-kernels auto`
(the default) therefore times whole forwards of the model at 1–8 rows with each kernel (both
copies of each weight kept while timing) and routes every call by its row count: stock up to the
largest row count where stock won, packed above (`choose_kernels`). The choice is cached per
machine and model (`choice_key`, `$DSPARKCTL_CACHE/cpu_kernels.json`), so the few seconds of
timing happen once; a cached choice makes only the copies it reads (engine/session.py).

Inference only: `PackedLinear` has no autograd, so training never packs (its draft backpropagates
through the target's borrowed LM head).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

ROWS_HINT = 8  # oneDNN packs for an expected row count; ≥ γ+1 of usual drafts, fine for 1 row too


class PackedLinear(nn.Module):
    """nn.Linear for inference: y = x Wᵀ + b with W packed once for oneDNN.

    `weight` stays reachable when asked (`keep_weight`: tied or borrowed weights, where it costs
    no memory, and small drafts that read `.weight.dtype`); otherwise only the packed copy lives.
    `stock_rows`: calls with at most this many rows take torch's stock kernel on `weight` instead
    (set by `use_stock_up_to`; 0 = always packed)."""

    stock_rows = 0

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
    by row count (`use_stock_up_to`; `--cpu-kernels auto`)."""
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


ROWS = (1, 2, 3, 4, 6, 8)  # 1 = a plain decode step; γ+1 = a static:γ verification
ALWAYS_STOCK = 10**9  # a stock_rows above any call's row count


def use_stock_up_to(module: nn.Module, rows: int, free: bool = False) -> None:
    """Route every PackedLinear under `module` to the stock kernel for calls of ≤ `rows` rows.
    `free`: drop the copy this routing never reads (the packed one when `rows` is ALWAYS_STOCK, the stock
    one when `rows` is 0 and the weight was only kept for routing)."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            if rows and not hasattr(m, "weight"):
                raise ValueError("a stock route needs the layer's weight (pack with keep_weight=True)")
            m.stock_rows = rows
            if free and rows >= ALWAYS_STOCK:
                m.packed = torch.empty(0)
            elif free and rows == 0 and getattr(m, "_weight_for_routing_only", False):
                del m.weight


def kernel_label(rows: int) -> str:
    """How a session's linears run, for reports: packed, stock, or stock<=N,packed."""
    return "packed" if rows == 0 else "stock" if rows >= ALWAYS_STOCK else f"stock<={rows},packed"


CHOICE_VERSION = 2  # bump when the timing or the rule changes: older cached choices are then ignored
MARGIN = 0.02  # a kernel must be this much faster to count as winning (ties keep one copy of the weights)


CACHE_NAME = "cpu_kernels.json"


CACHE_FORMAT = "dsparkctl-cpu-kernels/1"  # the marker: only a file carrying it is ever rewritten


def cache_path() -> Path:
    """`$DSPARKCTL_CPU_KERNELS_CACHE`, else `cpu_kernels.json` in the cache root (fsutil.cache_root)."""
    from dsparkctl.fsutil import cache_path

    return cache_path(CACHE_NAME, "DSPARKCTL_CPU_KERNELS_CACHE")


def _cpu_info() -> dict[str, str]:
    """The CPU's model name and a digest of its feature flags (VMs often report a generic name)."""
    info = {"name": platform.processor() or platform.machine(), "flags": ""}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not info["flags"]:
                info["name"] = value.strip()
            elif key.strip() in ("flags", "Features"):
                info["flags"] = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
                break
    except OSError:
        pass
    return info


_VOLATILE = ("_name_or_path", "_commit_hash", "transformers_version", "_attn_implementation_autoset")


def choice_key(model: nn.Module) -> str:
    """What a kernel choice depends on: the CPU (name and flags), torch, its thread count, the
    environment variables oneDNN/MKL/OpenMP read, and the model's config (not where it was read from)."""
    cfg = getattr(model, "config", None)
    model_doc: object = type(model).__name__
    if hasattr(cfg, "to_dict"):
        model_doc = {k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE}
    env = {k: v for k, v in os.environ.items() if k.startswith(("ONEDNN_", "DNNL_", "MKL_", "KMP_", "OMP_"))}
    doc = {"version": CHOICE_VERSION, "cpu": _cpu_info(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "env": env, "model": model_doc}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:24]


VALID_CHOICES = (0, *ROWS[:-1], ALWAYS_STOCK)


def _choices(doc: object) -> dict | None:
    """The choices of a parsed cache document, or None when it is not one of ours: our format
    (`{"format": CACHE_FORMAT, "choices": {...}}`), or the unmarked map that versions before the
    marker wrote (every value an entry with `stock_rows`)."""
    if not isinstance(doc, dict):
        return None
    if doc.get("format") == CACHE_FORMAT:
        return doc["choices"] if isinstance(doc.get("choices"), dict) else None
    if doc and "format" not in doc and all(isinstance(v, dict) and "stock_rows" in v for v in doc.values()):
        return dict(doc)
    return None


def _read_cache(path: Path) -> dict | None:
    """The cache's choices: {} for a missing file, None for one that is not a cache of ours
    (unreadable, damaged, someone's JSON, not a regular file: never opened then). Never an error."""
    from dsparkctl.fsutil import regular_file
    from dsparkctl.strict_json import loads

    try:
        if not os.path.lexists(path):
            return {}
        if not regular_file(path):  # a FIFO would block, a device stream, a link lead elsewhere
            return None
        return _choices(loads(path.read_bytes()))
    except (OSError, ValueError, RecursionError):
        return None


def cached_choice(model: nn.Module) -> int | None:
    """The cached stock_rows for this machine and model, or None (absent or not a valid choice)."""
    entry = (_read_cache(cache_path()) or {}).get(choice_key(model))
    rows = entry.get("stock_rows") if isinstance(entry, dict) else None
    return rows if type(rows) is int and rows in VALID_CHOICES else None


def time_rows(model: nn.Module, forward: Callable[[int], object], repeats: int = 5) -> dict[str, dict[int, float]]:
    """Median ms of `forward(rows)` for each row count in ROWS, all-packed vs all-stock, interleaved
    (so a drift of the machine hits both alike), after one warm-up of each."""
    times: dict[str, dict[int, list[float]]] = {"packed": {r: [] for r in ROWS}, "stock": {r: [] for r in ROWS}}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for rows in ROWS:
                for kind, route in (("packed", 0), ("stock", ALWAYS_STOCK)):
                    use_stock_up_to(model, route)
                    t0 = time.perf_counter()
                    forward(rows)
                    if rep:
                        times[kind][rows].append((time.perf_counter() - t0) * 1e3)
    return {k: {r: statistics.median(v) for r, v in d.items()} for k, d in times.items()}


def stock_rows_from(ms: dict[str, dict[int, float]]) -> int:
    """Stock up to the largest row count below which stock won every measurement (by MARGIN),
    packed above; ALWAYS_STOCK when packed then never wins clearly (one copy of the weights
    instead of two), 0 (packed) when stock does not win at one row."""
    rows = 0
    for r in ROWS:
        if ms["stock"][r] >= (1 - MARGIN) * ms["packed"][r]:
            break
        rows = r
    if rows and all(ms["packed"][r] >= (1 - MARGIN) * ms["stock"][r] for r in ROWS if r > rows):
        return ALWAYS_STOCK
    return rows


def choose_kernels(model: nn.Module, forward: Callable[[int], object], log: Callable[[str], None] = print,
                   repeats: int = 5) -> tuple[int, dict]:
    """(stock_rows, timings) for a model packed with both copies kept (`pack_linears(routing=True)`),
    timed now; the choice is cached for this machine and model (see `choice_key`). A cache that
    cannot be written is said once in the log: the next run times again."""
    log("timing this CPU's kernels on the target (once per machine and model, cached in "
        f"{cache_path()})")
    ms = time_rows(model, forward, repeats)
    rows = stock_rows_from(ms)
    timings = {k: {str(r): round(t, 3) for r, t in d.items()} for k, d in ms.items()}
    remember_choice(model, rows, {"forward_ms": timings}, log)
    return rows, ms


def remember_choice(model: nn.Module, rows: int, extra: dict, log: Callable[[str], None] = print) -> None:
    """Cache `rows` for this machine and model (with `extra` for the reader); a cache that cannot be
    written is said in the log: the next run times again."""
    entry = {"stock_rows": rows, "label": kernel_label(rows), "cpu": _cpu_info()["name"], "torch": torch.__version__,
             "threads": torch.get_num_threads(), **extra}
    path = cache_path()
    from dsparkctl.fsutil import cannot_create, replace_refusal, write_json

    try:
        cached = _read_cache(path)  # read again just before writing: another process may have added its own
        why = replace_refusal(path, ours=lambda p: cached is not None)
        if why:  # only a new path or a cache of ours is written: anything else is someone's, left alone
            log(f"note: {path} {why} (not a kernel-choice cache) and was left as it is; the next run times again "
                "(point $DSPARKCTL_CPU_KERNELS_CACHE at a new file, or pass --cpu-kernels packed or stock)")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        cached = dict(cached or {})
        cached[choice_key(model)] = entry
        write_json(path, {"format": CACHE_FORMAT, "choices": cached})
    except OSError as e:
        why = cannot_create(path) or e.strerror or str(e)
        log(f"note: could not cache the kernel choice in {path} ({why}); the next run times again "
            "(pass --cpu-kernels packed or stock to skip the timing)")


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


def kernels_of(model: nn.Module) -> str:
    """kernel_label of a model's linears ("stock" when none is packed)."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            return kernel_label(m.stock_rows)
    return "stock"
