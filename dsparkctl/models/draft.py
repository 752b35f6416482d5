"""The DSpark / DFlash draft: parallel backbone over a block, plus optional Markov and confidence heads.

Architecture (DSPARK.md, FORMATS.md §3; parameter names follow DeepSpec checkpoints):

    context  = hidden_norm(fc(concat of tapped target layer outputs))      [R, n, H]
    block    = embed_tokens([anchor, mask, ..., mask])                     [R, γ, H]
    per layer: Q from the (normed) block; K/V = [k/v_proj(context) ; k/v_proj(block)], with
               q_norm/k_norm (Qwen3 style) and RoPE at context positions 0..n-1 and block
               positions n..n+γ-1 (n = anchor position); no causal mask inside the block;
               the context enters every layer as the same projected features, never as queries.
    h        = norm(last layer output)                                     [R, γ, H]
    U        = lm_head(h)  (the target's head)                             [R, γ, V]
    conf_k   = confidence_head.proj([h_k ; W1[x_{k-1}]])  (raw logit)      [R, γ]

Reduced draft vocabulary (config `draft_vocab_size` K > 0; FR-Spec / EAGLE-3): the head is the
target head's rows at `draft_vocab_ids` [K] (a stored tensor, strictly increasing target ids),
so U is [R, γ, K] and the Markov head's W2 is [K, r]; W1 and the embedding stay target-sized.
Tokens outside the subset get draft probability 0, which verification handles exactly.

In inference the context keys/values are cached per layer and per row (`DraftState`): each
round appends the features of the tokens the target just committed. Rows are ragged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsparkctl.math.draft_sampling import DraftBlock, sample_block
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.models.markov_head import MarkovHead


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
                       write: "BlockSlots") -> Tensor:
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

    def forward_cached(self, x, cos, sin, keys, values, write: "BlockSlots"):
        """`forward` over the state's buffers (`DraftAttention.forward_cached`)."""
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, keys, values, write)
        return x + self.mlp(self.post_attention_layernorm(x))


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)


@dataclass
class DraftState:
    """Per-row context K/V for every draft layer. Row r's valid context is [:ctx_len[r]]; the
    slots after it are scratch, where each round's block K/V go (`BlockSlots`) until the
    committed tokens' context overwrites them.

    `pending` holds target features of tokens committed by steps that ran no draft (deferred
    `append_context` calls, oldest first): they enter the K/V cache, in order, before the next
    proposal, so a run of plain steps costs the draft nothing."""

    keys: list[Tensor]  # per layer [R, kvh, C, d]
    values: list[Tensor]
    ctx_len: Tensor  # [R] long
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (features [R, T, F], lengths [R])

    def keep_rows(self, rows: Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.ctx_len = self.ctx_len[rows]
        self.pending = [(f[rows], n[rows]) for f, n in self.pending]


@dataclass
class BlockSlots:
    """Where a block's γ K/V go in the state's buffers and what its queries may read.

    Row r's block takes slots ctx_len[r] .. ctx_len[r]+γ-1, right after its context, so row r
    reads slots < ctx_len[r]+γ. When every row's context has the same length n (always at batch
    1) the block is one slice [n, n+γ) and nothing needs a mask."""

    start: int | None  # n when every row's block starts there, else None (per-row `index`)
    index: Tensor | None  # [R, 1, γ, 1] long slot of each block token (ragged rows only)
    span: int  # slots attention reads: max ctx_len + γ
    mask: Tensor | None  # [R, 1, 1, span] bool (True = attend); None when uniform

    def put(self, buf: Tensor, x: Tensor) -> None:
        """Write the block's x [R, kvh, γ, d] into buf [R, kvh, C, d] at its slots."""
        if self.start is not None:
            buf[:, :, self.start: self.start + x.shape[2]] = x
        else:
            buf.scatter_(2, self.index.expand_as(x), x)


@dataclass
class DraftProposal:
    block: DraftBlock  # tokens [R, γ], probs [R, γ, V] (or None), markov_embeds
    confidence_logits: Tensor | None  # [R, γ] float32 raw logits (pre-sigmoid)


class DSparkDraft(nn.Module):
    """A DeepSpec-format DSpark (markov_rank > 0) or DFlash (markov_rank == 0) draft."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        K = cfg.output_vocab_size
        self.lm_head = nn.Linear(H, K, bias=False)
        if cfg.draft_vocab_size:
            self.register_buffer("draft_vocab_ids", torch.arange(K, dtype=torch.long))
        else:
            self.draft_vocab_ids = None
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.markov_head = (MarkovHead(cfg.vocab_size, cfg.markov_rank, H, cfg.markov_head_type, out_size=K)
                            if cfg.markov_rank > 0 else None)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            in_dim = H + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(in_dim)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def fingerprint(self) -> str:
        """A short digest of the draft's own weights (not the borrowed embedding/LM head) and
        block size: what a calibration file records, so it is never applied to another draft."""
        import hashlib

        h = hashlib.sha256(str(self.cfg.block_size).encode())
        # module by module, weight and bias by name: the same whether a linear was packed for the
        # CPU kernels (its bias then a buffer) or not
        for name, module in sorted(self.named_modules(), key=lambda nm: nm[0]):
            if name.split(".")[0] in ("embed_tokens", "lm_head"):
                continue
            for attr in ("weight", "bias"):
                t = getattr(module, attr, None)
                if isinstance(t, torch.Tensor):
                    h.update(f"{name}.{attr}".encode())
                    h.update(t.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    def share_target_embeddings(self, embed: nn.Module, head: nn.Module) -> None:
        """Borrow the target's frozen embedding and LM head (same modules, no copy).

        With a reduced vocabulary the head is a frozen copy of the target head's rows at
        `draft_vocab_ids` (call again after changing the ids)."""
        self.embed_tokens = embed
        if self.draft_vocab_ids is None:
            self.lm_head = head
            return
        sub = nn.Linear(head.weight.shape[1], self.draft_vocab_ids.numel(), bias=False,
                        device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            sub.weight.copy_(head.weight[self.draft_vocab_ids.to(head.weight.device)])
        sub.weight.requires_grad_(False)
        self.lm_head = sub

    def set_draft_vocab(self, ids: Tensor) -> None:
        """Install the reduced vocabulary's target ids [K] (strictly increasing)."""
        if self.draft_vocab_ids is None or ids.shape != self.draft_vocab_ids.shape:
            raise ValueError(f"draft vocabulary ids must have shape [{self.cfg.draft_vocab_size}]")
        self.draft_vocab_ids.copy_(ids)

    # ------------------------------------------------------------------ inference state
    def new_state(self, batch: int, device, dtype, capacity: int = 256) -> DraftState:
        shape = (batch, self.cfg.num_key_value_heads, capacity + 1, self.cfg.head_dim)  # +1 trash slot
        return DraftState(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in self.layers],
            ctx_len=torch.zeros(batch, dtype=torch.long, device=device),
        )

    def _ensure_capacity(self, state: DraftState, need: int) -> None:
        cap = state.keys[0].shape[2] - 1
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        def grow(t: Tensor) -> Tensor:
            pad = t.new_zeros(t.shape[0], t.shape[1], new_cap + 1 - t.shape[2], t.shape[3])
            return torch.cat([t, pad], dim=2)
        state.keys = [grow(k) for k in state.keys]
        state.values = [grow(v) for v in state.values]

    @torch.no_grad()
    def append_context(self, state: DraftState, features: Tensor, lengths: Tensor) -> None:
        """Append target features of newly committed tokens. features: [R, T, n_taps*H]; lengths: [R]."""
        R, T, _ = features.shape
        self._ensure_capacity(state, int((state.ctx_len + lengths).max()))
        cap = state.keys[0].shape[2] - 1
        t = torch.arange(T, device=features.device)
        ok = t[None, :] < lengths[:, None]  # [R, T]
        pos = state.ctx_len[:, None] + t[None, :]  # [R, T]
        slot = torch.where(ok, pos, torch.full_like(pos, cap))  # invalid writes go to the trash slot
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [R, T, H]
        cos, sin = self.rotary.at(pos, cap + 1, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)  # [R, kvh, T, d]
            idx = slot[:, None, :, None].expand_as(k)
            state.keys[i].scatter_(2, idx, k)
            state.values[i].scatter_(2, idx, v)
        state.ctx_len = state.ctx_len + lengths

    MAX_PENDING = 64  # deferred appends held before they are applied anyway (bounds their memory)

    def defer_context(self, state: DraftState, features: Tensor, lengths: Tensor) -> None:
        """`append_context`, applied at the next proposal (or once MAX_PENDING are waiting)."""
        state.pending.append((features, lengths))
        if len(state.pending) >= self.MAX_PENDING:
            self.flush_context(state)

    @torch.no_grad()
    def flush_context(self, state: DraftState) -> None:
        """Apply every deferred append, in order; uniform one-token chunks go in one call."""
        if not state.pending:
            return
        chunks, state.pending = state.pending, []
        if all(bool((n == f.shape[1]).all()) for f, n in chunks):
            feats = torch.cat([f for f, _ in chunks], dim=1)
            self.append_context(state, feats, torch.full_like(chunks[0][1], feats.shape[1]))
            return
        for f, n in chunks:
            self.append_context(state, f, n)

    @torch.no_grad()
    def backbone(self, state: DraftState, anchors: Tensor) -> Tensor:
        """One parallel forward over [anchor, mask × (γ-1)] -> final-normed hidden [R, γ, H]."""
        R, g = anchors.shape[0], self.cfg.block_size
        dev = anchors.device
        ids = torch.full((R, g), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        x = self.embed_tokens(ids).to(self.fc.weight.dtype)
        n = int(state.ctx_len.max())
        self._ensure_capacity(state, n + g)
        pos = state.ctx_len[:, None] + torch.arange(g, device=dev)[None, :]  # [R, γ]
        cos, sin = self.rotary.at(pos, state.keys[0].shape[2], x.dtype)
        if R == 1 or bool((state.ctx_len == n).all()):
            write = BlockSlots(start=n, index=None, span=n + g, mask=None)
        else:
            mask = (torch.arange(n + g, device=dev)[None, :] < (state.ctx_len + g)[:, None])[:, None, None, :]
            write = BlockSlots(start=None, index=pos[:, None, :, None], span=n + g, mask=mask)
        for i, layer in enumerate(self.layers):
            x = layer.forward_cached(x, cos, sin, state.keys[i], state.values[i], write)
        return self.norm(x)

    @torch.no_grad()
    def propose(self, state: DraftState, anchors: Tensor, params: SamplingParams,
                generator: torch.Generator | None, need_probs: bool = True) -> DraftProposal:
        """Draft one block for every row: parallel backbone, serial Markov loop, confidences.
        `need_probs=False` (greedy verification, which never reads q): the block holds no probs."""
        self.flush_context(state)
        h = self.backbone(state, anchors)  # [R, γ, H]
        base = self.lm_head(h.to(self.lm_head.weight.dtype)).float()  # [R, γ, V]
        need_h = self.markov_head is not None and self.markov_head.needs_hidden
        block = sample_block(base, anchors, self.markov_head, h if need_h else None, params, generator,
                             vocab_ids=self.draft_vocab_ids, need_probs=need_probs)
        conf = None
        if self.confidence_head is not None:
            feats = h
            if self.cfg.confidence_head_with_markov:
                feats = torch.cat([h, block.markov_embeds.to(h.dtype)], dim=-1)
            conf = self.confidence_head(feats.to(self.confidence_head.proj.weight.dtype)).float()
        return DraftProposal(block=block, confidence_logits=conf)

    # ------------------------------------------------------------------ training / teacher forcing
    def forward_blocks(self, features: Tensor, anchor_ids: Tensor, anchor_pos: Tensor) -> Tensor:
        """Many blocks per sequence in one forward (training and teacher-forced evaluation).

        features:   [B, S, n_taps*H] tapped target outputs for every position of the sequence
        anchor_ids: [B, N] token at each anchor position; anchor_pos: [B, N] its position
        Block n sees context positions < anchor_pos[b, n] and its own γ slots (bidirectional);
        never another block. Returns final-normed hidden states [B, N, γ, H] (differentiable).
        """
        B, S, _ = features.shape
        N, g = anchor_ids.shape[1], self.cfg.block_size
        dev = features.device
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [B, S, H]
        ids = torch.full((B, N, g), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = anchor_ids
        x = self.embed_tokens(ids.view(B, N * g)).to(ctx.dtype)  # [B, N*γ, H]
        q_pos = (anchor_pos[:, :, None] + torch.arange(g, device=dev)).view(B, N * g)
        cos_q, sin_q = self.rotary(q_pos, ctx.dtype)
        cos_c, sin_c = self.rotary(torch.arange(S, device=dev)[None].expand(B, S), ctx.dtype)
        q_anchor = anchor_pos.repeat_interleave(g, dim=1)  # [B, N*γ]
        ctx_ok = torch.arange(S, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, N*γ, S]
        blk = torch.arange(N * g, device=dev) // g
        own = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)  # [B, N*γ, N*γ]
        mask = torch.cat([ctx_ok, own], dim=2)[:, None]  # [B, 1, N*γ, S+N*γ]
        for layer in self.layers:
            ck, cv = layer.self_attn.kv(ctx, cos_c, sin_c)
            x = layer(x, cos_q, sin_q, ck, cv, mask)
        return self.norm(x).view(B, N, g, -1)

    def block_logits(self, hidden: Tensor, prev_tokens: Tensor) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced draft logits and confidence logits for blocks with known previous tokens.

        hidden: [..., γ, H] from `forward_blocks`; prev_tokens: [..., γ] = (anchor, x*_1..x*_{γ-1}).
        Returns logits [..., γ, K] (U + Markov bias; K = V unless the vocabulary is reduced, see
        `draft_vocab_ids`) and confidence logits [..., γ] or None.
        """
        lead = hidden.shape[:-2]
        g, H = hidden.shape[-2:]
        h = hidden.reshape(-1, g, H)
        prev = prev_tokens.reshape(-1, g)
        logits = self.lm_head(h.to(self.lm_head.weight.dtype))
        embeds = None
        if self.markov_head is not None:
            bias, embeds = self.markov_head.teacher_forced_bias(prev, h if self.markov_head.needs_hidden else None)
            logits = logits + bias
        conf = None
        if self.confidence_head is not None:
            feats = h
            if self.cfg.confidence_head_with_markov:
                feats = torch.cat([h, embeds.to(h.dtype)], dim=-1)
            conf = self.confidence_head(feats).reshape(*lead, g)
        return logits.reshape(*lead, g, -1), conf

    def full_vocab(self, probs: Tensor) -> Tensor:
        """Draft-vocabulary probabilities [..., K] -> target vocabulary [..., V] (zeros outside)."""
        if self.draft_vocab_ids is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.cfg.vocab_size)
        return full.index_copy_(-1, self.draft_vocab_ids, probs)
