"""A data part as the cache stores it: the tensors of `batch_size` sequences, how sequences pack
into them and back (`Sequence`), and the check a cached part must pass before it is used.

Per sequence of S tokens with prompt length P: `features[t]` is the tapped output at position
t (t = 0..S-2), and top-k row j is the target's distribution at position P-1+j, i.e. for the
token at P+j (j = 0..S-P-1), stored as ids (int32) and log-probabilities (fp16, T = 1). A part
concatenates its sequences: tokens, prompt_len and offsets (the token file), features, topk_ids
and topk_logp (the feature file).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sequence:
    tokens: torch.Tensor  # [S] long: prompt + response
    prompt_len: int  # P
    features: torch.Tensor  # [S-1, n_taps*H] fp16 tapped target layers at positions 0..S-2
    topk_ids: torch.Tensor  # [S-P, k] int32: target top-k for the token at P+j
    topk_logp: torch.Tensor  # [S-P, k] fp16 log-probabilities (T = 1) of those ids

    @property
    def response_len(self) -> int:
        return int(self.tokens.shape[0]) - self.prompt_len


def pack(seqs: list[list[int]], prompt_lens: list[int], feats: list[torch.Tensor], tki: list[torch.Tensor],
         tkl: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One part's tensors from its sequences (token ids), prompt lengths, features and top-k rows."""
    offs = [0]
    for s in seqs:
        offs.append(offs[-1] + len(s))
    return {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.long),
            "prompt_len": torch.tensor(prompt_lens, dtype=torch.long), "offsets": torch.tensor(offs),
            "features": torch.cat([f[: len(s) - 1] for f, s in zip(feats, seqs)]).contiguous(),
            "topk_ids": torch.cat([t[: len(s) - p] for t, s, p in zip(tki, seqs, prompt_lens)]).contiguous(),
            "topk_logp": torch.cat([t[: len(s) - p] for t, s, p in zip(tkl, seqs, prompt_lens)]).contiguous()}


def unpack(tokens: dict[str, torch.Tensor], feats: dict[str, torch.Tensor]) -> list[Sequence]:
    """The sequences of a part, from its token and feature tensors (views, no copies)."""
    out = []
    offs = tokens["offsets"].tolist()
    plens = tokens["prompt_len"].tolist()
    foff = koff = 0
    for i in range(len(offs) - 1):
        S, P = offs[i + 1] - offs[i], plens[i]
        out.append(Sequence(tokens=tokens["tokens"][offs[i]: offs[i + 1]], prompt_len=P,
                            features=feats["features"][foff: foff + S - 1],
                            topk_ids=feats["topk_ids"][koff: koff + S - P],
                            topk_logp=feats["topk_logp"][koff: koff + S - P]))
        foff += S - 1
        koff += S - P
    return out


def check_part(toks: dict[str, torch.Tensor], feats: dict[str, torch.Tensor] | None, part: list[dict],
               n_features: int, topk: int, vocab: int) -> str:
    """"" when a cached part fits the items it was built from and the recipe; else why not. The
    token file: the part's prompts, in order, each followed by ids inside the vocabulary; the
    feature file: one feature row per position but the last, one top-k row per response token."""
    if set(toks) != {"tokens", "prompt_len", "offsets"} or any(t.dtype != torch.long or t.dim() != 1
                                                               for t in toks.values()):
        return "holds other tensors than a token part"
    offs, plen, ids = toks["offsets"].tolist(), toks["prompt_len"].tolist(), toks["tokens"]
    if len(offs) != len(part) + 1 or len(plen) != len(part) or offs[0] != 0 or offs[-1] != ids.numel():
        return "does not hold this part's sequences"
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return "holds token ids outside the target's vocabulary"
    for i, it in enumerate(part):
        S = offs[i + 1] - offs[i]
        if plen[i] != len(it["prompt"]) or S <= plen[i] or ids[offs[i]: offs[i] + plen[i]].tolist() != it["prompt"]:
            return f"sequence {i} is not the prompt it was built from"
    if feats is None:
        return ""
    n_feat = sum(offs[i + 1] - offs[i] - 1 for i in range(len(part)))
    n_resp = sum(offs[i + 1] - offs[i] - plen[i] for i in range(len(part)))
    if not {"features", "topk_ids", "topk_logp"} <= set(feats) <= {"features", "topk_ids", "topk_logp", *toks}:
        return "holds other tensors than a feature part"  # (older versions also kept the token tensors here)
    f, ki, kl = feats["features"], feats["topk_ids"], feats["topk_logp"]
    if f.dtype != torch.float16 or tuple(f.shape) != (n_feat, n_features) or not bool(torch.isfinite(f).all()):
        return f"features are {tuple(f.shape)} {f.dtype}, expected ({n_feat}, {n_features}) finite float16"
    if ki.dtype != torch.int32 or tuple(ki.shape) != (n_resp, topk) or (ki.numel() and (
            int(ki.min()) < 0 or int(ki.max()) >= vocab)):
        return "top-k ids do not fit the part"
    if kl.dtype != torch.float16 or tuple(kl.shape) != (n_resp, topk) or bool(kl.isnan().any()) or bool((kl > 0).any()):
        return "top-k log-probabilities do not fit the part"
    return ""
