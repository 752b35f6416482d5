"""What a target model says about itself before any generation: how many positions it was built
for (and whether the prompts and budget fit them), and a cheap fingerprint of its weights."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from dsparkctl.errors import UsageError, option


def position_limit(model: torch.nn.Module) -> int | None:
    """The most positions the model was built for (`max_position_embeddings` or its aliases), if it says."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_positions(model: Any, ids: Sequence[Sequence[int]], max_new_tokens: int, block_size: int) -> None:
    """Refuse prompts that would run past the model's positions before any generation starts."""

    limit = position_limit(model)
    longest = max(len(p) for p in ids)
    name = option("max_new_tokens")
    if limit is not None and longest + block_size + 2 > limit:  # the prompt alone leaves no room for one token
        raise UsageError(f"the longest prompt ({longest} tokens) fills the target's {limit} positions "
                         "(max_position_embeddings)", f"shorten it to at most {max(1, limit - block_size - 2)} tokens")
    if limit is not None and longest + max_new_tokens + block_size + 1 > limit:
        raise UsageError(f"the longest prompt ({longest} tokens) + {name} {max_new_tokens} runs past "
                         f"the target's {limit} positions (max_position_embeddings)",
                         f"shorten the prompt or use {name} ≤ {max(1, limit - longest - block_size - 1)}")


def model_fingerprint(model: torch.nn.Module) -> str:
    """Config + a few weight slices: cheap, and different for any other checkpoint in practice."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    for p in (params[0], params[len(params) // 2], params[-1]):
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
