"""The DSpark / DFlash draft: parallel backbone over a block, plus optional Markov and confidence heads.

Architecture (docs/background.md §4, docs/formats.md §3; parameter names follow DeepSpec checkpoints):

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

This module holds the draft's weights and its training-time forward over many blocks at once
(`forward_blocks`, `block_logits`); the layers are models/draft_layers.py, and the inference
rounds (context cache, `propose`) models/draft_inference.py.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn

from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.models.draft_inference import DraftInference
from dsparkctl.models.draft_layers import ConfidenceHead, DraftLayer, RMSNorm, Rotary
from dsparkctl.models.markov_head import MarkovHead


class DSparkDraft(DraftInference, nn.Module):
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
        """γ: drafts per round (the block's slots, less the anchor's when it predicts nothing)."""
        return self.cfg.drafts_per_block

    def fingerprint(self) -> str:
        """A short digest of the draft's own weights (not the borrowed embedding/LM head) and
        block size: what a calibration file records, so it is never applied to another draft."""
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

    # ------------------------------------------------------------------ training / teacher forcing
    def forward_blocks(self, features: Tensor, anchor_ids: Tensor, anchor_pos: Tensor) -> Tensor:
        """Many blocks per sequence in one forward (training and teacher-forced evaluation).

        features:   [B, S, n_taps*H] tapped target outputs for every position of the sequence
        anchor_ids: [B, N] token at each anchor position; anchor_pos: [B, N] its position
        Block n sees context positions < anchor_pos[b, n] and its own γ slots (bidirectional);
        never another block. Returns final-normed hidden states [B, N, γ, H] (differentiable).
        """
        B, S, _ = features.shape
        N, g = anchor_ids.shape[1], self.cfg.block_size  # slots (γ or γ + 1, `sample_from_anchor`)
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
        return self.norm(x).view(B, N, g, -1)[:, :, self.cfg.slot_offset:]

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
