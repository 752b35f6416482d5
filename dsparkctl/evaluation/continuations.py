"""Target continuations, computed once: teacher-forced evaluation of a new draft needs only the
target's own answers, which do not change between drafts.

The key covers what the answers depend on: the model (config and a fingerprint of its weights),
dtype and device type, the prompt ids, max new tokens, sampling settings, seed, stop ids and the
batch size (batches are seeded separately, engine/decode.py). Files live under
`$DSPARKCTL_CACHE/continuations/` (default ~/.cache/dsparkctl), written atomically; a corrupt
or foreign file is recomputed, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dsparkctl.distributed import DATA_PARALLEL, Split
from dsparkctl.evaluation.live import target_continuations
from dsparkctl.files.atomic import atomic_open, cannot_create
from dsparkctl.files.cache import cache_location
from dsparkctl.files.os_errors import os_error_words
from dsparkctl.files.ownership import NotOurs, cache_entry, regular_file, replace_refusal
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.packed_linear import PackedLinear, route_of
from dsparkctl.models.target_checks import model_fingerprint
from dsparkctl.strict_json import loads

FORMAT = "dsparkctl-continuations/1"


def cache_dir() -> Path:
    """`$DSPARKCTL_CONTINUATIONS_CACHE`, else `continuations/` of the cache root (files.cache.cache_root)."""

    return cache_location("continuations", "DSPARKCTL_CONTINUATIONS_CACHE")


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
        doc["kernels"] = route_of(model).label
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def _marks(head: bytes) -> bool:
    """An entry of this cache, even a damaged one: it begins with our format (written first)."""
    return f'"format": "{FORMAT}"'.encode() in head[:64]


# What this cache may replace: an entry it recorded writing, or one that carries its format; a file of
# anyone else's, where $DSPARKCTL_CONTINUATIONS_CACHE points, is left alone.
_entry = cache_entry(_marks)


def _digest(conts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(conts, separators=(",", ":")).encode()).hexdigest()


def read_entry(path: Path, key: str, n_prompts: int, vocab_size: int, max_new_tokens: int) -> tuple[Any, str | None]:
    """(continuations, None) from a valid cache entry; (None, why) otherwise ("" when there is
    none). Valid, like user input: a regular file (a FIFO is never opened), strict JSON, our
    format and key, one list per prompt of at most max_new_tokens ids inside the vocabulary, and
    the digest of exactly those lists (a damaged but well-formed entry would change τ)."""

    if not os.path.lexists(path):
        return None, ""
    if not regular_file(path):
        return None, "is not a regular file"
    try:
        doc: Any = loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"cannot be read as JSON ({type(exc).__name__})"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("key") != key:
        return None, "is not an entry of this cache"
    conts = doc.get("continuations")
    if not isinstance(conts, list) or len(conts) != n_prompts:
        return None, "holds the wrong number of continuations"
    for c in conts:
        if not isinstance(c, list) or len(c) > max_new_tokens or not all(
                type(t) is int and 0 <= t < vocab_size for t in c):
            return None, "holds a continuation that is not a list of token ids of this model"
    if "sha256" not in doc:
        return None, "was written by an older version (no digest)"
    if doc["sha256"] != _digest(conts):
        return None, "does not match its own digest (damaged)"
    return conts, None


def cache_problem(folder: Path | None = None) -> str | None:
    """Why continuations cannot be cached (checked before any work, said as a note), or None."""

    folder = folder or cache_dir()
    if os.path.lexists(folder) and not folder.is_dir():
        return f"{folder} is not a folder"
    if folder.is_dir():
        return None if os.access(folder, os.W_OK | os.X_OK) else f"no permission to write in {folder}"
    return cannot_create(folder / "x")


def cached_continuations(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         max_new_tokens: int, stop_ids: Sequence[int], seed: int = 0,
                         batch_size: int = 8, log: Callable[[str], None] = lambda s: None,
                         split: Split = DATA_PARALLEL) -> tuple[list[list[int]], bool]:
    """(continuations, from_cache). A damaged entry is discarded and recomputed, with a note; a
    cache that cannot be written is said before the work, and the result is still returned."""

    key = continuations_key(model, prompts, params, max_new_tokens, stop_ids, seed, batch_size)
    path = cache_dir() / f"{key}.json"
    head = model.get_output_embeddings()
    vocab = max(int(getattr(model.config, "vocab_size", 0) or 0), int(head.weight.shape[0]) if head is not None else 0)
    conts, why = read_entry(path, key, len(prompts), vocab, max_new_tokens)
    if conts is not None:
        return conts, True
    if why:
        log(f"note: the cached continuations {path} {why}; recomputing them")
    problem = cache_problem()
    if problem:
        log(f"note: continuations cannot be cached ({problem}); computing them without the cache")
    conts = target_continuations(model, prompts, params, max_new_tokens, stop_ids, seed, batch_size, split)
    if not problem:  # under torchrun rank 0 alone writes (files.atomic.atomic_open)
        refusal = replace_refusal(path, ours=_entry)
        if refusal:
            log(f"note: {path} {refusal}; left as it is, continuations not cached")
            return conts, False
        try:  # judged again on the very file replaced: one put there meanwhile stays
            with atomic_open(path, "w", ours=_entry) as fh:
                json.dump({"format": FORMAT, "key": key, "sha256": _digest(conts), "continuations": conts}, fh)
        except NotOurs as exc:
            log(f"note: {exc.message}; continuations not cached")
        except OSError as exc:

            words = os_error_words(exc)
            log(f"note: could not cache the continuations in {path} ({words[0] if words else exc}); "
                "the next run computes them again")
    return conts, False
