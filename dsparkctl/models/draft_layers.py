"""The layers a DSpark draft is built from: RMS norm, rotary positions, block attention over a
context, the gated MLP, the confidence head (models/draft.py assembles them).

Attention (docs/background.md §4): Q from the (normed) block; K/V = [k/v_proj(context) ; k/v_proj(block)],
with q_norm/k_norm (Qwen3 style) and RoPE at context positions 0..n-1 and block positions
n..n+γ-1 (n = anchor position); no causal mask inside the block; the context enters every layer
as the same projected features, never as queries. `forward` takes the context's K/V as tensors
(training, teacher forcing); `forward_cached` reads them from the inference state's buffers and
writes the block's K/V where `BlockSlots` says (models/draft_inference.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.models.draft_inference import BlockSlots


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._table: tuple[Tensor, Tensor] | None = None  # inference: cos, sin [P, d] of positions 0..P-1

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions: [R, T] -> cos, sin [R, 1, T, d]
        f = positions.float()[..., None] * self.inv_freq  # [R, T, d/2]
        emb = torch.cat([f, f], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def at(self, positions: Tensor, need: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """`forward` by lookup in a table of positions 0..need-1 (at least), built once and grown by
        doubling (inference: no cos/sin per round). positions: [R, T] (< need) -> cos, sin [R, 1, T, d]."""
        tab = self._table
        if tab is None or tab[0].shape[0] < need or tab[0].device != self.inv_freq.device or tab[0].dtype != dtype:
            P = max(need, 2 * tab[0].shape[0] if tab is not None else 256)
            cos, sin = self.forward(torch.arange(P, device=self.inv_freq.device)[None], dtype)
            self._table = tab = (cos[0, 0], sin[0, 0])
        return tab[0][positions][:, None], tab[1][positions][:, None]


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=b)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=b)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=b)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=b)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x: [R, T, H] -> k, v: [R, kvh, T, d] (k normed and rotated)."""
        R, T, _ = x.shape
        k = self.k_proj(x).view(R, T, self.n_kv, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(R, T, self.n_kv, self.head_dim)
        return rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: [R, T, H] -> q: [R, heads, T, d] (normed and rotated)."""
        R, T, _ = x.shape
        q = self.q_proj(x).view(R, T, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rope(q.transpose(1, 2), cos, sin)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q: [R, heads, γ, d]; k/v: [R, kvh, S, d]; mask: [R, 1, γ|1, S] bool or None -> [R, γ, H].

        When the mask is the same for every query (None or [R, 1, 1, S]), the query heads that
        share a K/V head are folded into the query axis ([R, kvh, heads/kvh·γ, d]): the same
        products as grouped-query attention without repeating K/V (faster on CPU, same values)."""
        R, h, g, d = q.shape
        if self.n_heads != self.n_kv and (mask is None or mask.shape[2] == 1):
            out = F.scaled_dot_product_attention(q.reshape(R, self.n_kv, -1, d), k, v, attn_mask=mask).view(R, h, g, d)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(R, g, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                mask: Tensor) -> Tensor:
        """x: [R, γ, H] block; ctx_k/v: [R, kvh, n, d]; mask: [R, 1, γ|1, n+γ] bool (True = attend)."""
        bk, bv = self.kv(x, cos, sin)
        return self.attend(self.q(x, cos, sin), torch.cat([ctx_k, bk], dim=2), torch.cat([ctx_v, bv], dim=2), mask)

    def forward_cached(self, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                       write: BlockSlots) -> Tensor:
        """Inference: `forward` with the context in the state's buffers keys/values [R, kvh, C, d]:
        the block's K/V go into the slots after each row's context (never read once the round
        is over: they lie past ctx_len) and attention reads the buffer in place, no concatenation."""
        bk, bv = self.kv(x, cos, sin)
        write.put(keys, bk)
        write.put(values, bv)
        return self.attend(self.q(x, cos, sin), keys[:, :, : write.span], values[:, :, : write.span], write.mask)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, cos, sin, keys, values, write: BlockSlots):
        """`forward` over the state's buffers (`DraftAttention.forward_cached`)."""
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, keys, values, write)
        return x + self.mlp(self.post_attention_layernorm(x))


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)
