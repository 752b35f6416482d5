"""Target continuations, computed once: teacher-forced evaluation of a new draft needs only the
target's own answers, which do not change between drafts.

The key covers what the answers depend on: the model (config and a fingerprint of its weights),
dtype and device type, the prompt ids, max new tokens, sampling settings, seed, stop ids and the
batch size (batches are seeded separately, engine/run.py). Files live under
`$DSPARKCTL_CACHE/continuations/` (default ~/.cache/dsparkctl), written atomically; a corrupt
or foreign file is recomputed, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from dsparkctl.evaluation.live import target_continuations
from dsparkctl.fsutil import atomic_open
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.cpu_kernels import PackedLinear, kernels_of

FORMAT = "dsparkctl-continuations/1"


def cache_dir() -> Path:
    """`$DSPARKCTL_CONTINUATIONS_CACHE`, else `$DSPARKCTL_CACHE/continuations` (~/.cache/dsparkctl)."""
    if os.environ.get("DSPARKCTL_CONTINUATIONS_CACHE"):
        return Path(os.environ["DSPARKCTL_CONTINUATIONS_CACHE"])
    return Path(os.environ.get("DSPARKCTL_CACHE", Path.home() / ".cache" / "dsparkctl")) / "continuations"


def model_fingerprint(model: torch.nn.Module) -> str:
    """Config + a few weight slices: cheap, and different for any other checkpoint in practice."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    for p in (params[0], params[len(params) // 2], params[-1]):
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def continuations_key(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                      max_new_tokens: int, stop_ids: Sequence[int], seed: int, batch_size: int) -> str:
    p = next(model.parameters())
    doc = {"model": model_fingerprint(model), "dtype": str(p.dtype), "device": p.device.type,
           "prompts": hashlib.sha256(json.dumps([list(map(int, x)) for x in prompts]).encode()).hexdigest(),
           "max_new_tokens": max_new_tokens, "sampling": [params.temperature, params.top_k, params.top_p],
           "stop": sorted(int(s) for s in stop_ids), "seed": seed, "batch_size": batch_size}
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        # other kernels, other rounding: near-ties may decode differently, so a cache of their own
        # (and the fingerprint above then sees the parameters left outside the packed linears)
        doc["kernels"] = kernels_of(model)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def cached_continuations(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         max_new_tokens: int, stop_ids: Sequence[int], seed: int = 0,
                         batch_size: int = 8) -> tuple[list[list[int]], bool]:
    """(continuations, from_cache)."""
    key = continuations_key(model, prompts, params, max_new_tokens, stop_ids, seed, batch_size)
    path = cache_dir() / f"{key}.json"
    try:
        doc: Any = json.loads(path.read_text())
        conts = doc["continuations"]
        if doc.get("format") == FORMAT and doc.get("key") == key and len(conts) == len(prompts) and all(
                isinstance(c, list) and all(isinstance(t, int) for t in c) for c in conts):
            return conts, True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    conts = target_continuations(model, prompts, params, max_new_tokens, stop_ids, seed, batch_size)
    from dsparkctl.distributed import world

    if world().main:
        with atomic_open(path, "w") as fh:
            json.dump({"format": FORMAT, "key": key, "continuations": conts}, fh)
    return conts, False
