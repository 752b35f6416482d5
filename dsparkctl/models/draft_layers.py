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
from dsparkctl.models.packed_linear import EVERY_CALL, PackedLinear
from dsparkctl.models.quant_linear import Int8Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and not torch.is_grad_enabled():
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one op; the same fp32 arithmetic
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
        tab = self._table_for(need, dtype)
        return tab[0][positions][:, None], tab[1][positions][:, None]

    def span(self, start: int, count: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """`at` for positions start .. start+count-1, the same for every row: cos, sin [1, 1, count, d],
        views of the table."""
        tab = self._table_for(start + count, dtype)
        return tab[0][None, None, start:start + count], tab[1][None, None, start:start + count]

    def _table_for(self, need: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        tab = self._table
        if tab is None or tab[0].shape[0] < need or tab[0].device != self.inv_freq.device or tab[0].dtype != dtype:
            P = max(need, 2 * tab[0].shape[0] if tab is not None else 256)
            cos, sin = self.forward(torch.arange(P, device=self.inv_freq.device)[None], dtype)
            self._table = tab = (cos[0, 0], sin[0, 0])
        return tab


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


FUSE_MAX_BYTES = 64 << 20  # fused copies only for layers whose q/k/v and gate/up weights stay under this (small
                            # drafts: op count matters there; a big draft would double those weights' memory)


def _weights_key(tensors: list[Tensor | None], lins: list[nn.Module]) -> tuple | None:
    """What a fused copy was made from: each tensor itself (compared by identity) with its storage,
    version and dtype, and each linear's kernel route; None when a tensor is not reachable (a
    packed linear that dropped its weight). Optimizers that update in place without a version
    bump (fused AdamW) are covered by `drop_inference_caches`, which `train()` and the trainer call."""
    if any(t is None for t in tensors):
        return None
    return (tuple((id(t), t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
            + tuple((type(m).__name__, getattr(m, "stock_rows", None)) for m in lins))


def fuse_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear whose output is the concatenation of `parts`' outputs (same input), running on the
    kernel the first part runs on (packed for oneDNN, with its stock-rows routing, int8, or stock)."""
    w = torch.cat([p.weight.detach() for p in parts])
    if isinstance(parts[0], Int8Linear):
        return Int8Linear(w, None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts]))
    lin = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if parts[0].bias is not None:
        lin.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    first = parts[0]
    if isinstance(first, PackedLinear) and first.stock_rows != EVERY_CALL:
        packed = PackedLinear(lin, keep_weight=bool(first.stock_rows))  # the joined weight only where it is read
        packed.stock_rows = first.stock_rows
        return packed
    return lin


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
    _fused: tuple | None = None  # (key, q/k/v linear, gate/up linear, q/k norm weights, source tensors)

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fused(self) -> tuple[nn.Module, nn.Module, Tensor | None] | None:
        """Inference copies for `forward_fused`: q/k/v as one linear, gate/up as one, and the q and
        k norms' weights side by side [heads + kv heads, d] (None without qk_norm). Made on first
        use and again whenever a weight changed (training between evaluations); None when a
        weight is not reachable or the two norms differ in eps (the per-op path then runs)."""
        a, m = self.self_attn, self.mlp
        lins = [a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj]
        norms = [a.q_norm, a.k_norm] if a.q_norm is not None else []
        if norms and a.q_norm.eps != a.k_norm.eps:
            return None
        tensors = ([getattr(p, "weight", None) for p in lins] + [p.bias for p in lins if p.bias is not None]
                   + [n.weight for n in norms])
        key = _weights_key(tensors, lins)
        if key is None or sum(p.weight.numel() * p.weight.element_size() for p in lins) > FUSE_MAX_BYTES:
            self._fused = None
            return None
        if self._fused is None or self._fused[0] != key:
            qk_w = None
            if norms:
                d = a.head_dim
                qk_w = torch.cat([a.q_norm.weight.detach().expand(a.n_heads, d),
                                  a.k_norm.weight.detach().expand(a.n_kv, d)])
            self._fused = (key, fuse_linears(lins[:3]), fuse_linears(lins[3:]), qk_w, tensors)  # held: ids stay valid
        return self._fused[1:4]

    def drop_inference_caches(self) -> None:
        self._fused = None

    def train(self, mode: bool = True):
        self.drop_inference_caches()  # weights are about to change: the next inference rebuilds
        return super().train(mode)

    def forward_fused(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                      start: int, fused: tuple[nn.Module, nn.Module, Tensor | None]) -> Tensor:
        """Inference when every row's context has the same length `start`, in fewer and larger ops:
        the block x [R, γ, H] and ctx [R, T, H], the (projected, normed) features of the T tokens
        committed since the last proposal (T may be 0), go through ONE q/k/v product; their K/V
        fill slots start .. start+T+γ-1 of keys/values [R, kvh, C, d] (the tokens' for good, the
        block's as scratch), and the block attends to the buffer up to there, unmasked. cos/sin:
        [R|1, 1, T+γ, d] at those positions. The same products as `append_context` then
        `forward_cached`. `fused`: what `fused()` returned (not None)."""
        qkv_lin, gu_lin, qk_w = fused
        a = self.self_attn
        R, g, _ = x.shape
        T, nq = ctx.shape[1], a.n_heads + a.n_kv
        h = self.input_layernorm(x)
        qkv = qkv_lin(torch.cat([ctx, h], dim=1) if T else h).view(R, T + g, nq + a.n_kv, a.head_dim)
        qk = qkv[:, :, :nq]
        if qk_w is not None:
            qk = F.rms_norm(qk, (a.head_dim,), None, a.q_norm.eps) * qk_w
        qk = rope(qk.transpose(1, 2), cos, sin)  # [R, heads + kvh, T+γ, d]
        end = start + T + g
        keys[:, :, start:end] = qk[:, a.n_heads:]
        values[:, :, start:end] = qkv[:, :, nq:].transpose(1, 2)
        x = x + a.attend(qk[:, : a.n_heads, T:], keys[:, :, :end], values[:, :, :end], None)
        gate, up = gu_lin(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.mlp.down_proj(F.silu(gate) * up)

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
