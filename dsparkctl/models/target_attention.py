"""Grouped-query attention for a verify forward without copying K/V.

transformers' SDPA path folds the query heads that share a K/V head into the query axis only for
one new token (a plain decode step). For several new tokens with a mask, a verification, it
repeats K and V to every query head first (`repeat_kv`): each layer copies its whole cached K/V
before attending, and on one CPU core that copy and the wider attention made a 3-token verify of
SmolLM2 cost ~15% more than a 1-token step while its linears cost the same. Here the fold covers
any number of new tokens: q [B, heads, T, d] -> [B, kv_heads, rep*T, d] (row r*T + t is query
head kv*rep + r at token t), the [B, 1, T, S] mask repeated to match. The products are the ones
SDPA computes after `repeat_kv`, over the same keys; only the kernel's blocking may differ.

Registered with transformers' attention interface as `dsparkctl-sdpa` (its masks are SDPA's), and
set by `fold_gqa` on a target whose attention is `sdpa`. Everything the fold does not cover (a
per-head mask, no mask with several tokens, soft-capping, position biases, attention sinks, sliding
windows, training) goes to transformers' own SDPA function unchanged, and so does a forward of more
than MAX_FOLD_TOKENS new tokens (a prefill: compute-bound, and its repeated mask would be rep·T·S
floats held for the forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "dsparkctl-sdpa"
_UNFOLDABLE = ("softcap", "position_bias", "s_aux", "sinks", "sliding_window")
MAX_FOLD_TOKENS = 16  # a verification's width (γ + 1); a prefill is compute-bound and its repeated mask large
_last_mask: list = [None, None, None]  # (the mask a forward passes to every layer, (rep, dtype), its fold)


def _repeated(mask: torch.Tensor, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, 1, T, S] -> [B, 1, rep*T, S], row r*T + t = row t, a boolean mask made additive (0 or
    -inf, as SDPA itself converts it at every call); built once per forward: every layer of a forward
    gets the same mask object."""
    if _last_mask[0] is not mask or _last_mask[1] != (rep, dtype):
        m = mask.repeat(1, 1, rep, 1)
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
        _last_mask[:] = [mask, (rep, dtype), m]
    return _last_mask[2]


def folded_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature; returns (attn_output [B, T, heads, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rep = int(getattr(module, "num_key_value_groups", 1) or 1)
    B, h, T, d = query.shape
    foldable = (rep > 1 and 1 < T <= MAX_FOLD_TOKENS and attention_mask is not None and attention_mask.dim() == 4
                and attention_mask.shape[1] == 1 and attention_mask.shape[2] == T and dropout == 0.0
                and key.shape[1] * rep == h and key.shape[-1] == value.shape[-1] == d
                and not module.training and all(kwargs.get(k) is None for k in _UNFOLDABLE))
    if not foldable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q = query.reshape(B, h // rep, rep * T, d)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=_repeated(attention_mask, rep, query.dtype), scale=scaling)  # [B, kvh, rep*T, d]
    return out.view(B, h, T, d).transpose(1, 2).contiguous(), None


def _register() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # a transformers without the attention interface: keep its own attention
        return False
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(NAME, folded_sdpa)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])
    return True


def reads_bool_masks(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention reads a prepared boolean [B, 1, T, S] mask as "may attend" (SDPA
    and `dsparkctl-sdpa`; eager attention adds a mask to its scores, so a boolean one masks nothing)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_attn_implementation", None) in ("sdpa", NAME)


def fold_gqa(model: torch.nn.Module) -> bool:
    """Route `model`'s SDPA attention through `folded_sdpa` (a grouped-query target only).
    Returns whether it did; a model on another attention (eager, flash, flex) is left alone."""
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "text_config", None) or cfg
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if (cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa" or not heads or not kv or heads == kv
            or not hasattr(model, "set_attn_implementation") or not _register()):
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, KeyError, TypeError):  # a model that cannot switch attention at run time
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME
