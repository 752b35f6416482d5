"""The draft at inference: its per-row context K/V cache and one round's proposal.

In inference the context keys/values are cached per layer and per row (`DraftState`): each
step defers the features of the tokens the target just committed (`defer_context`), and the next
`propose` takes them in and drafts one block for every row: one parallel backbone pass over
[anchor, mask × (γ-1)] whose block K/V go into scratch slots after each row's context
(`BlockSlots`), the serial Markov loop (math/draft_sampling.py), and the confidence logits. When
every row's context has the same length the pending tokens ride along in the layers' fused
products (`DraftLayer.forward_fused`); otherwise they are appended first (`append_context`).
Rows are ragged.

`DraftInference` holds these methods for `DSparkDraft` (models/draft.py), whose modules
(`cfg`, `embed_tokens`, `fc`, `hidden_norm`, `layers`, `norm`, `rotary`, `lm_head`,
`markov_head`, `confidence_head`, `draft_vocab_ids`) they use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsparkctl.math.draft_sampling import DraftBlock, sample_block
from dsparkctl.math.sampling import SamplingParams


@dataclass
class DraftState:
    """Per-row context K/V for every draft layer. Row r's valid context is [:ctx_len[r]]; the
    slots after it are scratch, where each round's block K/V go (`BlockSlots`) until the
    committed tokens' context overwrites them.

    `pending` holds target features of tokens committed since the last proposal (deferred
    `append_context` calls, oldest first): they enter the K/V cache, in order, at the next
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


class DraftInference:
    """`DSparkDraft`'s inference-time methods: the context cache and `propose` (see the module doc)."""

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
        pos = state.ctx_len[:, None] + t[None, :]  # [R, T]
        n = int(state.ctx_len[0]) if R else 0
        if n + T <= cap and bool((state.ctx_len == n).all()):
            # one slice (always at batch 1): a row's slots past its length get scratch, never read
            write = BlockSlots(start=n, index=None, span=n + T, mask=None)
        else:
            slot = torch.where(t[None, :] < lengths[:, None], pos, torch.full_like(pos, cap))  # invalid: trash slot
            write = BlockSlots(start=None, index=slot[:, None, :, None], span=cap + 1, mask=None)
        ctx = self.context_rows(features)  # [R, T, H]
        cos, sin = self.rotary.at(pos, cap + 1, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)  # [R, kvh, T, d]
            write.put(state.keys[i], k)
            write.put(state.values[i], v)
        state.ctx_len = state.ctx_len + lengths

    def context_rows(self, features: Tensor) -> Tensor:
        """Target features [R, T, n_taps*H] -> the rows the layers project to context K/V [R, T, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    MAX_PENDING = 64  # deferred appends held before they are applied anyway (bounds their memory)

    def defer_context(self, state: DraftState, features: Tensor, lengths: Tensor) -> None:
        """`append_context`, applied at the next proposal (or once MAX_PENDING are waiting)."""
        state.pending.append((features, lengths))
        if len(state.pending) >= self.MAX_PENDING:
            self.flush_context(state)

    @torch.no_grad()
    def flush_context(self, state: DraftState) -> None:
        """Apply every deferred append, in order; chunks whose rows agree on their counts go in one call."""
        if state.pending:
            chunks, state.pending = state.pending, []
            self._append_chunks(state, chunks, self._joined(chunks))

    @staticmethod
    def _joined(chunks: list[tuple[Tensor, Tensor]]) -> Tensor | None:
        """The chunks' kept features as one [R, T, F] when, in each chunk, every row kept the same
        count (always at batch 1; a feed may be wider than what was kept); else None."""
        counts = [int(n[0]) if n.numel() else 0 for _, n in chunks]
        if not all(bool((n == c).all()) for (_, n), c in zip(chunks, counts)):
            return None
        return torch.cat([f[:, :c] for (f, _), c in zip(chunks, counts)], dim=1)

    def _append_chunks(self, state: DraftState, chunks: list[tuple[Tensor, Tensor]], joined: Tensor | None) -> None:
        if joined is None:
            for f, n in chunks:
                self.append_context(state, f, n)
        elif joined.shape[1]:
            self.append_context(state, joined, torch.full_like(chunks[0][1], joined.shape[1]))

    FUSE_ROWS = 16  # pending tokens a proposal takes into its first q/k/v product; more are appended first

    def _take_pending(self, state: DraftState) -> Tensor | None:
        """The pending features as one [R, T, F] (`_joined`) when T ≤ FUSE_ROWS: removed from
        `pending`, not yet applied. Otherwise every pending chunk is applied now and None is returned."""
        if not state.pending:
            return None
        chunks, state.pending = state.pending, []
        joined = self._joined(chunks)
        if joined is not None and 0 < joined.shape[1] <= self.FUSE_ROWS:
            return joined
        self._append_chunks(state, chunks, joined)
        return None

    @torch.no_grad()
    def backbone(self, state: DraftState, anchors: Tensor) -> Tensor:
        """Apply the pending context, then one parallel forward over [anchor, mask × (slots-1)] ->
        final-normed hidden [R, γ, H] of the slots that draft (all, or all but the anchor's). When every row's context has the same length (always at
        batch 1) the pending tokens ride along in the layers' q/k/v products
        (`DraftLayer.forward_fused`); ragged rows append them first and read the buffers masked."""
        R, g = anchors.shape[0], self.cfg.block_size  # slots; the drafts are the last γ of them
        dev = anchors.device
        feats = self._take_pending(state)
        ids = torch.full((R, g), self.cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        x = self.embed_tokens(ids).to(self.fc.weight.dtype)
        n = int(state.ctx_len.max())
        uniform = R == 1 or bool((state.ctx_len == n).all())
        fused = [layer.fused() for layer in self.layers] if uniform else None
        if fused is not None and all(f is not None for f in fused):
            T = 0 if feats is None else feats.shape[1]
            self._ensure_capacity(state, n + T + g)
            ctx = x[:, :0] if feats is None else self.context_rows(feats)
            cos, sin = self.rotary.span(n, T + g, x.dtype)
            for i, (layer, fz) in enumerate(zip(self.layers, fused)):
                x = layer.forward_fused(x, ctx, cos, sin, state.keys[i], state.values[i], n, fz)
            state.ctx_len = state.ctx_len + T
            return self.norm(x[:, self.cfg.slot_offset:])
        if feats is not None:
            self.append_context(state, feats, torch.full_like(state.ctx_len, feats.shape[1]))
            n = int(state.ctx_len.max())
            uniform = R == 1 or bool((state.ctx_len == n).all())
        self._ensure_capacity(state, n + g)
        pos = state.ctx_len[:, None] + torch.arange(g, device=dev)[None, :]  # [R, γ]
        cos, sin = self.rotary.at(pos, state.keys[0].shape[2], x.dtype)
        if uniform:
            write = BlockSlots(start=n, index=None, span=n + g, mask=None)
        else:
            mask = (torch.arange(n + g, device=dev)[None, :] < (state.ctx_len + g)[:, None])[:, None, None, :]
            write = BlockSlots(start=None, index=pos[:, None, :, None], span=n + g, mask=mask)
        for i, layer in enumerate(self.layers):
            x = layer.forward_cached(x, cos, sin, state.keys[i], state.values[i], write)
        return self.norm(x[:, self.cfg.slot_offset:])

    @torch.no_grad()
    def propose(self, state: DraftState, anchors: Tensor, params: SamplingParams,
                generator: torch.Generator | None, need_probs: bool = True, alternatives: int = 0) -> DraftProposal:
        """Draft one block for every row: parallel backbone, serial Markov loop, confidences.
        `need_probs=False` (greedy verification, which never reads q): the block holds no probs.
        `alternatives` (greedy): also position 1's next-best tokens, the engine's siblings."""
        h = self.backbone(state, anchors)  # [R, γ, H] (the pending context goes in first)
        base = self.lm_head(h.to(self.lm_head.weight.dtype)).float()  # [R, γ, V]
        need_h = self.markov_head is not None and self.markov_head.needs_hidden
        block = sample_block(base, anchors, self.markov_head, h if need_h else None, params, generator,
                             vocab_ids=self.draft_vocab_ids, need_probs=need_probs,
                             alternatives=alternatives if params.greedy and not need_probs else 0)
        conf = None
        if self.confidence_head is not None:
            feats = h
            if self.cfg.confidence_head_with_markov:
                feats = torch.cat([h, block.markov_embeds.to(h.dtype)], dim=-1)
            conf = self.confidence_head(feats.to(self.confidence_head.proj.weight.dtype)).float()
        return DraftProposal(block=block, confidence_logits=conf)
