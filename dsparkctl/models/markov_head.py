"""DSpark's sequential Markov head: a low-rank logit bias from the previous draft token.

Parameter names and shapes follow DeepSpec checkpoints (prefix `markov_head.` in the draft):

    markov_w1.weight   [V, r]       nn.Embedding(V, r)          W1, indexed by x_{k-1} (target id)
    markov_w2.weight   [V', r]      nn.Linear(r, V', bias=False) W2; V' = V, or the draft's reduced
                                                                 vocabulary K (its output side only)
    gated only:
    gate_proj.weight   [r, H + r]   nn.Linear(H + r, r)          input [h_k ; W1[x_{k-1}]]
    gate_proj.bias     [r]
    rnn only:
    joint_proj.weight  [3r, 2r + H] nn.Linear(2r + H, 3r)        input [s_{k-1} ; W1[x_{k-1}] ; h_k]
    joint_proj.bias    [3r]

Per step k (1..γ), with e = W1[x_{k-1}] and h_k the draft backbone's (final-normed) hidden state
at block slot k-1 (the slot whose base logits are U_k):

    vanilla: bias_k = W2 e
    gated:   g = σ(gate_proj([h_k ; e])),  bias_k = W2 (g ⊙ e)
    rnn:     [g_raw ; c_raw ; o_raw] = joint_proj([s_{k-1} ; e ; h_k])   (split in this order)
             s_k = σ(g_raw) ⊙ s_{k-1} + (1 - σ(g_raw)) ⊙ tanh(c_raw),  s_0 = 0
             bias_k = W2 tanh(o_raw)

Source of these facts: DeepSpec's `deepspec/modeling/dspark/markov_head.py` (classes
VanillaMarkov / GatedMarkovHead / RNNHead), read in two public forks of deepseek-ai/DeepSpec
(curnane-lab/DeepSpec, fg11991/DeepSpec; identical formulas). The upstream repository's copy of
that file was not in the index we could read, but upstream `qwen3/modeling.py` imports
`build_markov_head` from it, so the forks are taken as faithful. The rnn state is held in the
hidden states' dtype and starts at zero for every block, as there.

`markov_embed` (what the confidence head concatenates with h_k) is W1[x_{k-1}] for ALL kinds:
upstream `Qwen3DSparkModel.predict_confidence_step` uses `markov_head.get_prev_embeddings(prev)`
regardless of the head type, so the gated/state vectors are deliberately not used there.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsparkctl.errors import UsageError

__all__ = ["MarkovHead", "MARKOV_HEAD_KINDS"]

MARKOV_HEAD_KINDS = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str = "vanilla",
                 out_size: int | None = None):
        super().__init__()
        kind = str(kind).lower()
        if kind not in MARKOV_HEAD_KINDS:
            raise UsageError(
                f"unknown Markov head type {kind!r}",
                hint=f"use one of {', '.join(MARKOV_HEAD_KINDS)} (config field markov_head_type)",
            )
        if rank <= 0:
            raise UsageError(f"Markov head rank must be > 0, got {rank}",
                             hint="a draft with markov_rank 0 has no Markov head (DFlash)")
        self.kind = kind
        self.vocab_size = int(vocab_size)
        self.rank = int(rank)
        self.hidden_size = int(hidden_size)
        self.markov_w1 = nn.Embedding(self.vocab_size, self.rank)
        self.out_size = int(out_size or vocab_size)
        self.markov_w2 = nn.Linear(self.rank, self.out_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(self.hidden_size + self.rank, self.rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * self.rank + self.hidden_size, 3 * self.rank)

    @property
    def needs_hidden(self) -> bool:
        return self.kind != "vanilla"

    def init_state(self, batch: int, device, dtype) -> Tensor | None:
        """Recurrent state s_0 [batch, r] (zeros) for rnn; None for vanilla and gated."""
        if self.kind != "rnn":
            return None
        return torch.zeros(batch, self.rank, device=device, dtype=dtype)

    def step(
        self,
        prev_tokens: Tensor,      # [R] long, x_{k-1}
        hidden: Tensor | None,    # [R, H] backbone hidden at this step (gated/rnn only)
        state: Tensor | None,     # [R, r] rnn state s_{k-1} (None -> zeros), else ignored
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """One serial step -> (bias [R, V'], markov_embed [R, r] = W1[x_{k-1}], new_state)."""
        embed = self.markov_w1(prev_tokens)                                  # [R, r]
        if self.kind == "vanilla":
            return self.markov_w2(embed), embed, None
        if hidden is None:
            raise ValueError(f"the {self.kind} Markov head needs the backbone hidden state h_k")
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(embed.dtype), embed], dim=-1)))
            return self.markov_w2(gate * embed), embed, None
        # rnn
        if state is None:
            state = torch.zeros(embed.shape[0], self.rank, device=embed.device, dtype=hidden.dtype)
        z = torch.cat([state.to(embed.dtype), embed, hidden.to(embed.dtype)], dim=-1)
        g_raw, c_raw, o_raw = self.joint_proj(z).chunk(3, dim=-1)
        g = torch.sigmoid(g_raw)
        new_state = g * state.to(g.dtype) + (1.0 - g) * torch.tanh(c_raw)
        return self.markov_w2(torch.tanh(o_raw)), embed, new_state.to(state.dtype)

    def step_logits(
        self,
        base: Tensor,             # [R, V'] base logits U_k of this step
        prev_tokens: Tensor,      # [R] long, x_{k-1}
        hidden: Tensor | None,    # [R, H] (gated/rnn only)
        state: Tensor | None,     # [R, r] rnn state
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """`step` with its bias added to `base` -> (logits [R, V'], markov_embed [R, r], new_state).

        Inference (no grad) with a vanilla head: one addmm over a contiguous copy of W2ᵀ [r, V'],
        made once per weight version. A product of a few rows is about twice as fast that way on
        CPU as over W2's V' rows of r; the values are the same up to summation order."""
        w = getattr(self.markov_w2, "weight", None)
        if (self.kind == "vanilla" and isinstance(w, Tensor) and not torch.is_grad_enabled()
                and base.dtype == w.dtype == self.markov_w1.weight.dtype):
            embed = self.markov_w1(prev_tokens)                              # [R, r]
            return torch.addmm(base, embed, self._w2_t(w)), embed, None
        bias, embed, state = self.step(prev_tokens, hidden, state)
        return base + bias, embed, state

    _w2t: tuple[Tensor, int, Tensor] | None = None  # (W2 it was made from, its version, W2ᵀ contiguous)

    def drop_inference_caches(self) -> None:
        self._w2t = None

    def train(self, mode: bool = True):
        self.drop_inference_caches()  # W2 is about to change (fused AdamW bumps no version)
        return super().train(mode)

    def _w2_t(self, w: Tensor) -> Tensor:
        """W2ᵀ [r, V'] contiguous, remade when W2 is another tensor or was changed in place."""
        c = self._w2t
        if c is None or c[0] is not w or c[1] != w._version:
            c = self._w2t = (w, w._version, w.detach().t().contiguous())
        return c[2]

    def teacher_forced_bias(
        self,
        prev_tokens: Tensor,      # [R, γ] long, x_0..x_{γ-1}
        hidden: Tensor | None,    # [R, γ, H]
    ) -> tuple[Tensor, Tensor]:
        """Bias for a whole block with known previous tokens -> (bias [R, γ, V'], embeds [R, γ, r])."""
        R, g = prev_tokens.shape
        if self.kind == "vanilla":
            embeds = self.markov_w1(prev_tokens)
            return self.markov_w2(embeds), embeds
        dtype = hidden.dtype if hidden is not None else self.markov_w1.weight.dtype
        state = self.init_state(R, prev_tokens.device, dtype)
        biases, embeds = [], []
        for k in range(g):
            b, e, state = self.step(prev_tokens[:, k], None if hidden is None else hidden[:, k], state)
            biases.append(b)
            embeds.append(e)
        return torch.stack(biases, dim=1), torch.stack(embeds, dim=1)
