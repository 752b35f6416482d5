"""This machine's SPS table, profiled once and cached (like the CPU kernel choice).

A confidence-scheduled policy needs the engine's step costs (drafted steps on a grid of
requests × tokens, and the plain step). When `generate` runs such a policy without
`--sps-table`, the table is profiled here with a small grid (1..γ+1 tokens each, 9 repeats after
two warm-up passes; the fit reads each probe's lower quartile) over the request counts the run can
reach: 1, 2, 4, 8 up to the first one at or above its batch size (a batch-1 run profiles 7 probes,
not 28; a cached table of a wider grid serves any narrower need), and kept under
`$DSPARKCTL_CACHE/sps/<key>.json` (`$DSPARKCTL_SPS_CACHE` names the folder itself). The key covers
what step times depend on: the machine and torch's threads, the kernels, device and dtype, the
target's and the draft's weights, the grid and the context length, and a rule version. A damaged
or unreadable cache file is profiled again; an unwritable cache is said and the table used for
this run only. Delete the file (or pass `--sps-table`) to measure again.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from dsparkctl.engine.profile import profile_table
from dsparkctl.errors import DsparkError
from dsparkctl.files.atomic import cannot_create, write_json
from dsparkctl.files.cache import cache_location
from dsparkctl.files.ownership import NotOurs, cache_entry, replace_refusal
from dsparkctl.formats.sps import load_sps_table, table_json
from dsparkctl.math.sps import SPSTable
from dsparkctl.models.target_checks import model_fingerprint, position_limit
from dsparkctl.strict_json import loads

RULE = 2  # bump when what is profiled or how it is fitted changes
REQUESTS = (1, 2, 4, 8)
CONTEXT = 256


def _key(sess, gamma: int, requests: tuple[int, ...] = REQUESTS) -> str:

    doc = {"rule": RULE, "conditions": sess.conditions(), "target": model_fingerprint(sess.target.model),
           "draft": sess.draft.fingerprint(), "block_size": gamma, "requests": list(requests), "context": CONTEXT}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def requests_for(batch_size: int | None) -> tuple[int, ...]:
    """The request counts a run of `batch_size` needs priced: REQUESTS up to the first one at or
    above it (all of them when unknown or larger; the table extrapolates past its last row)."""
    if batch_size is None:
        return REQUESTS
    upto = next((i for i, r in enumerate(REQUESTS) if r >= batch_size), len(REQUESTS) - 1)
    return REQUESTS[: upto + 1]


def cache_dir() -> Path:
    """`$DSPARKCTL_SPS_CACHE`, else `sps/` of the cache root (files.cache.cache_root)."""

    return cache_location("sps", "DSPARKCTL_SPS_CACHE")


def cache_path(sess, requests: tuple[int, ...] = REQUESTS) -> Path:
    return cache_dir() / f"{_key(sess, sess.draft.block_size, requests)}.json"


def _cached(sess, path: Path) -> SPSTable | None:

    if not path.is_file():
        return None
    try:
        table = load_sps_table(path)
    except (DsparkError, OSError, ValueError):
        return None  # damaged: profiled again
    return table if table.has_plain and table.meta.get("block_size") == sess.draft.block_size else None


def machine_sps_table(sess, log: Callable[[str], None] = print, batch_size: int | None = None) -> SPSTable:
    """The session's whole-step SPS table for this machine, for runs of up to `batch_size` requests
    (None: every grid row): cached (a wider grid serves too), else profiled now and cached."""

    need = requests_for(batch_size)
    for wider in range(len(REQUESTS), len(need) - 1, -1):
        if (table := _cached(sess, cache_path(sess, REQUESTS[:wider]))) is not None:
            return table
    path = cache_path(sess, need)
    gamma = sess.draft.block_size

    limit = position_limit(sess.target.model)
    context = CONTEXT if limit is None else max(1, min(CONTEXT, limit - gamma - 2))
    probes = len(need) * (gamma + 2)  # every drafted width and the plain step, per request count
    log(f"profiling this machine's step costs once ({probes} probes: requests {','.join(map(str, need))} × "
        f"1..{gamma + 1} tokens and the plain step; cached in {path})")
    table, _ = profile_table(sess, "whole-step", need, list(range(1, gamma + 2)), context, repeats=9, warmup=2,
                             draft=sess.draft_name, cached_by="generate", on_sweep=_eta(log))
    table.source = str(path)

    if (why := cannot_create(path) or replace_refusal(path, ours=_entry)) is not None:
        log(f"note: the SPS cache {path} cannot be written ({why}); the table is used for this run only")
        return table
    try:  # judged again on the very file replaced: one put there meanwhile stays
        write_json(path, table_json(table), ours=_entry)
    except NotOurs as e:
        log(f"note: the SPS cache {path} cannot be written ({e.message}); the table is used for this run only")
    except OSError as e:
        log(f"note: the SPS cache {path} cannot be written ({e.strerror or e}); the table is used for this run only")
    return table


def _marks(content: bytes) -> bool:
    """An entry of this cache: strict JSON in our table format that says it was cached by
    `generate` (`machine_sps_table` writes both)."""
    try:
        doc = loads(content)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and str(doc.get("format", "")).startswith("dsparkctl-sps/") \
        and doc.get("cached_by") == "generate"


# What this cache may replace: an entry it recorded writing, or one whose own marks it reads; a file
# of anyone else's, put where $DSPARKCTL_SPS_CACHE points, is left alone (a damaged entry too: said).
_entry = cache_entry(_marks, size=16 << 20)


def _eta(log: Callable[[str], None]) -> Callable[[int, int], None]:
    """A progress line per pass over the probes, with the time left estimated from the passes so far."""
    start = time.perf_counter()

    def on_sweep(done: int, total: int) -> None:
        left = (time.perf_counter() - start) / done * (total - done)
        log(f"  step costs: pass {done}/{total}, about {left:.0f} s left")
    return on_sweep
