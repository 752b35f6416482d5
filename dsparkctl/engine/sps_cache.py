"""This machine's SPS table, profiled once and cached (like the CPU kernel choice).

A confidence-scheduled policy needs the engine's step costs (drafted steps on a grid of
requests × tokens, and the plain step). When `generate` runs such a policy without
`--sps-table`, the table is profiled here with a small grid (1, 2, 4 and 8 requests, 1..γ+1
tokens each, 3 repeats after a warm-up) and
kept under `$DSPARKCTL_CACHE/sps/<key>.json` (`$DSPARKCTL_SPS_CACHE` names the folder itself). The key covers what step times depend on: the
machine and torch's threads, the kernels, device and dtype, the target's and the draft's weights,
the grid and the context length, and a rule version. A damaged or unreadable cache file is
profiled again; an unwritable cache is said and the table used for this run only. Delete the
file (or pass `--sps-table`) to measure again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from dsparkctl.errors import DsparkError
from dsparkctl.math.sps import SPSTable

RULE = 1  # bump when what is profiled or how it is fitted changes
REQUESTS = (1, 2, 4, 8)
CONTEXT = 256


def _key(sess, gamma: int) -> str:
    from dsparkctl.evaluation.continuations import model_fingerprint

    doc = {"rule": RULE, "conditions": sess.conditions(), "target": model_fingerprint(sess.target.model),
           "draft": sess.draft.fingerprint(), "block_size": gamma, "requests": REQUESTS, "context": CONTEXT}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def cache_dir() -> Path:
    """`$DSPARKCTL_SPS_CACHE`, else `sps/` of the cache root (fsutil.cache_root)."""
    from dsparkctl.fsutil import cache_path

    return cache_path("sps", "DSPARKCTL_SPS_CACHE")


def cache_path(sess) -> Path:
    return cache_dir() / f"{_key(sess, sess.draft.block_size)}.json"


def machine_sps_table(sess, log: Callable[[str], None] = print) -> SPSTable:
    """The session's whole-step SPS table for this machine: cached, else profiled now and cached."""
    from dsparkctl.engine.profile import profile_table
    from dsparkctl.fsutil import cannot_create
    from dsparkctl.sps_io import load_sps_table, save_sps_table

    path = cache_path(sess)
    if path.is_file():
        try:
            table = load_sps_table(path)
            if table.has_plain and table.meta.get("block_size") == sess.draft.block_size:
                return table
        except (DsparkError, OSError, ValueError):
            pass  # damaged: profiled again below
    gamma = sess.draft.block_size
    from dsparkctl.engine.profile import position_limit

    limit = position_limit(sess.target.model)
    context = CONTEXT if limit is None else max(1, min(CONTEXT, limit - gamma - 2))
    log(f"profiling this machine's step costs once (requests {','.join(map(str, REQUESTS))} × 1..{gamma + 1} "
        f"tokens, cached in {path})")
    table, _ = profile_table(sess, "whole-step", REQUESTS, list(range(1, gamma + 2)), context, repeats=3, warmup=1,
                             draft=sess.draft_name, cached_by="generate")
    table.source = str(path)
    from dsparkctl.fsutil import replace_refusal

    if (why := cannot_create(path) or replace_refusal(path, ours=lambda p: True)) is not None:  # a damaged entry of this cache is ours; a link, FIFO or folder is not
        log(f"note: the SPS cache {path} cannot be written ({why}); the table is used for this run only")
        return table
    try:
        save_sps_table(table, path)
    except OSError as e:
        log(f"note: the SPS cache {path} cannot be written ({e.strerror or e}); the table is used for this run only")
    return table
