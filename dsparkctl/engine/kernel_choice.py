"""Which CPU kernel route a target takes under `--cpu-kernels auto`: timed once per machine and
model, cached, and the same on every rank (the `nn.Module` work is in models/packed_linear.py).

Which kernel wins depends on the CPU: on one 2-core machine the packed kernel won at every row
count (1.04× at one row, 1.4–1.8× at 2–8); on another (an AMX-capable Xeon) torch's stock kernels
were 1.2× faster up to 3 rows and the packed ones 1.06× faster from 4 rows on. So `auto` times
whole forwards of the model at 1–8 rows with each kernel (both copies of each weight kept while
timing) and routes every call by its row count: stock up to the largest row count where stock
won, packed above (`choose_kernels`). The choice is cached per machine and model (`choice_key`,
`$DSPARKCTL_CACHE/cpu_kernels.json`), so the few seconds of timing happen once; `resolve` is the
one reader of that cache (under torchrun rank 0 reads or times, and every rank takes its route).
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

from dsparkctl.distributed import from_main
from dsparkctl.files.atomic import cannot_create, write_json
from dsparkctl.files.cache import cache_location
from dsparkctl.files.ownership import NotOurs, regular_file, replace_refusal
from dsparkctl.models.packed_linear import EVERY_CALL, STOCK, Route, pack_linears, use_stock_up_to
from dsparkctl.strict_json import loads

ROWS = (1, 2, 3, 4, 6, 8)  # 1 = a plain decode step; γ+1 = a static:γ verification
CHOICE_VERSION = 2  # bump when the timing or the rule changes: older cached choices are then ignored
MARGIN = 0.02  # a kernel must be this much faster to count as winning (ties keep one copy of the weights)
CACHE_NAME = "cpu_kernels.json"
CACHE_FORMAT = "dsparkctl-cpu-kernels/1"  # the marker: only a file carrying it is ever rewritten
STOCK_IN_FILE = 10**9  # how the cache file writes the stock route: a `stock_rows` above any call's rows


def resolve(model: nn.Module, keep: tuple[nn.Module, ...], log: Callable[[str], None] = print) -> Route:
    """The route for `--cpu-kernels auto`: the cached choice for this machine and model, else
    timed now on the model packed with both copies kept (left so for `apply_route`). A model
    whose forward needs more than input_ids stays on stock kernels (remembered). Under torchrun
    rank 0 alone reads the cache or times, and every rank returns its route."""

    def choose() -> Route:
        cached = cached_choice(model)
        if cached is not None:
            return cached
        if not pack_linears(model, keep=keep, routing=True):
            return STOCK
        try:
            return choose_kernels(model, row_forward(model), log=log)[0]
        except Exception as e:  # a model whose forward needs more than input_ids: stay on stock kernels
            log(f"note: could not time the CPU kernels on this target ({type(e).__name__}); using stock "
                "kernels (pass --cpu-kernels packed to pack anyway)")
            remember_choice(model, STOCK, {"reason": f"forward failed: {type(e).__name__}"}, log)
            return STOCK
    return from_main(choose)


def row_forward(model: nn.Module) -> Callable[[int], object]:
    """A forward of the model over `rows` tokens (no cache): what kernel timing runs."""
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    ids = (torch.arange(1, 9) % vocab)[None].to(next(model.parameters()).device)
    return lambda rows: model(input_ids=ids[:, :rows], use_cache=False)


# ------------------------------------------------------------------------------------ timing
def time_rows(model: nn.Module, forward: Callable[[int], object], repeats: int = 5) -> dict[str, dict[int, float]]:
    """Median ms of `forward(rows)` for each row count in ROWS, all-packed vs all-stock, interleaved
    (so a drift of the machine hits both alike), after one warm-up of each."""
    times: dict[str, dict[int, list[float]]] = {"packed": {r: [] for r in ROWS}, "stock": {r: [] for r in ROWS}}
    with torch.inference_mode():
        for rep in range(repeats + 1):
            for rows in ROWS:
                for kind, stock_rows in (("packed", 0), ("stock", EVERY_CALL)):
                    use_stock_up_to(model, stock_rows)
                    t0 = time.perf_counter()
                    forward(rows)
                    if rep:
                        times[kind][rows].append((time.perf_counter() - t0) * 1e3)
    return {k: {r: statistics.median(v) for r, v in d.items()} for k, d in times.items()}


def route_from(ms: dict[str, dict[int, float]]) -> Route:
    """Stock up to the largest row count below which stock won every measurement (by MARGIN),
    packed above; all stock when packed then never wins clearly (one copy of the weights instead
    of two), all packed when stock does not win at one row."""
    rows = 0
    for r in ROWS:
        if ms["stock"][r] >= (1 - MARGIN) * ms["packed"][r]:
            break
        rows = r
    if rows and all(ms["packed"][r] >= (1 - MARGIN) * ms["stock"][r] for r in ROWS if r > rows):
        return STOCK
    return Route(packed=True, stock_rows=rows)


def choose_kernels(model: nn.Module, forward: Callable[[int], object], log: Callable[[str], None] = print,
                   repeats: int = 5) -> tuple[Route, dict]:
    """(route, timings) for a model packed with both copies kept (`pack_linears(routing=True)`),
    timed now; the choice is cached for this machine and model (see `choice_key`). A cache that
    cannot be written is said once in the log: the next run times again."""
    log("timing this CPU's kernels on the target (once per machine and model, cached in "
        f"{cache_path()})")
    ms = time_rows(model, forward, repeats)
    route = route_from(ms)
    timings = {k: {str(r): round(t, 3) for r, t in d.items()} for k, d in ms.items()}
    remember_choice(model, route, {"forward_ms": timings}, log)
    return route, ms


# ------------------------------------------------------------------------------------ the cache
def cache_path() -> Path:
    """`$DSPARKCTL_CPU_KERNELS_CACHE`, else `cpu_kernels.json` in the cache root (files.cache.cache_root)."""

    return cache_location(CACHE_NAME, "DSPARKCTL_CPU_KERNELS_CACHE")


def cpu_info() -> dict[str, str]:
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
    doc = {"version": CHOICE_VERSION, "cpu": cpu_info(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "env": env, "model": model_doc}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:24]


def rows_in_file(route: Route) -> int:
    """A route as the cache file writes it (`stock_rows`: 0 packed, N mixed, STOCK_IN_FILE stock)."""
    return route.stock_rows if route.packed else STOCK_IN_FILE


def route_in_file(rows: object) -> Route | None:
    """The route a cache entry's `stock_rows` stands for; None when it is no choice we make."""
    if type(rows) is not int or rows not in (0, *ROWS[:-1], STOCK_IN_FILE):
        return None
    return STOCK if rows == STOCK_IN_FILE else Route(packed=True, stock_rows=rows)


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

    try:
        if not os.path.lexists(path):
            return {}
        if not regular_file(path):  # a FIFO would block, a device stream, a link lead elsewhere
            return None
        return _choices(loads(path.read_bytes()))
    except (OSError, ValueError, RecursionError):
        return None


def _ours(path: Path) -> bool:
    """A kernel-choice cache of ours, read from the file itself (its marker, or the unmarked map of
    older versions: `_choices`); a file of anyone else's is not replaced."""
    return _read_cache(path) is not None


def cached_choice(model: nn.Module) -> Route | None:
    """The cached route for this machine and model, or None (absent or not a valid choice)."""
    entry = (_read_cache(cache_path()) or {}).get(choice_key(model))
    return route_in_file(entry.get("stock_rows")) if isinstance(entry, dict) else None


def remember_choice(model: nn.Module, route: Route, extra: dict, log: Callable[[str], None] = print) -> None:
    """Cache `route` for this machine and model (with `extra` for the reader); a cache that cannot be
    written is said in the log: the next run times again."""
    entry = {"stock_rows": rows_in_file(route), "label": route.label, "cpu": cpu_info()["name"],
             "torch": torch.__version__, "threads": torch.get_num_threads(), **extra}
    path = cache_path()

    try:
        cached = _read_cache(path)  # read again just before writing: another process may have added its own
        why = replace_refusal(path, ours=_ours)
        if not why:
            path.parent.mkdir(parents=True, exist_ok=True)
            cached = dict(cached or {})
            cached[choice_key(model)] = entry
            try:  # judged again on the very file replaced: one put there meanwhile stays
                write_json(path, {"format": CACHE_FORMAT, "choices": cached}, ours=_ours)
                return
            except NotOurs:
                why = "was put there while this run timed the kernels"
        # only a new path or a cache of ours is written: anything else is someone's, left alone
        log(f"note: {path} {why} (not a kernel-choice cache) and was left as it is; the next run times again "
            "(point $DSPARKCTL_CPU_KERNELS_CACHE at a new file, or pass --cpu-kernels packed or stock)")
    except OSError as e:
        why = cannot_create(path) or e.strerror or str(e)
        log(f"note: could not cache the kernel choice in {path} ({why}); the next run times again "
            "(pass --cpu-kernels packed or stock to skip the timing)")
