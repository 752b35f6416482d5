"""The draft vocabulary's three spellings, and the exact rules between them (docs/formats.md).

  index (canonical, dsparkctl): `draft_vocab_ids` [K] int64, strictly increasing target ids
  d2t (speculators, EAGLE-3):   `d2t` [K] int64 offsets, target id = i + d2t[i]; `t2d` [V] bool,
                                 True exactly at the K target ids; a full vocabulary is K = V,
                                 d2t all zero, t2d all true
  full (SpecForge, ModelOpt):    no map; the Markov head's W2 and the head span the target's V

index <-> d2t is a bijection (nothing changes); index -> full is a change (`expand`), refused
unless the user drops the map by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsparkctl.errors import CheckpointError

W2 = "markov_head.markov_w2.weight"


def check_index(ids: Tensor, vocab: int, k: int | None, where: str) -> None:
    """[K] int64 target ids, in range, strictly increasing (and K as the config says)."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise CheckpointError(f"{where}: draft_vocab_ids must be a 1-D int64 tensor, got {ids.dtype} "
                              f"{list(ids.shape)}", "re-export the draft with dsparkctl")
    if k is not None and ids.numel() != k:
        raise CheckpointError(f"{where}: the vocabulary map holds {ids.numel()} ids but config.json says "
                              f"draft_vocab_size {k}", "fix draft_vocab_size in config.json")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise CheckpointError(f"{where}: the vocabulary map has target ids outside the vocabulary [0, {vocab}) "
                              f"(min {int(ids.min())}, max {int(ids.max())})",
                              "the map must hold ids of the target's vocabulary (is vocab_size right?)")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{where}: the vocabulary map is not strictly increasing (duplicate or unsorted "
                              "target ids)", "the map must list distinct target ids in ascending order")


def ids_from_d2t(d2t: Tensor, t2d: Tensor | None, vocab: int, where: str) -> Tensor:
    """speculators' (d2t, t2d) -> the index map, checking that the two agree."""
    if d2t.dim() != 1 or d2t.dtype not in (torch.int64, torch.int32):
        raise CheckpointError(f"{where}: d2t must be a 1-D integer tensor, got {d2t.dtype} {list(d2t.shape)}",
                              "re-export the draft (d2t holds int64 offsets: target id = i + d2t[i])")
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise CheckpointError(f"{where}: d2t maps draft ids to target ids outside the vocabulary [0, {vocab}) "
                              f"(min {int(ids.min())}, max {int(ids.max())})",
                              "the offsets must land in the target's vocabulary (is vocab_size right?)")
    if t2d is not None:
        if t2d.dim() != 1 or t2d.numel() != vocab or t2d.dtype not in (torch.bool, torch.uint8, torch.int8):
            raise CheckpointError(f"{where}: t2d must be a 1-D bool mask over the {vocab} target ids, got "
                                  f"{t2d.dtype} {list(t2d.shape)}", "re-export the draft")
        mask_ids = torch.nonzero(t2d.bool()).flatten().to(torch.int64)
        if mask_ids.numel() != ids.numel() or not torch.equal(mask_ids, torch.sort(ids).values):
            raise CheckpointError(f"{where}: d2t and t2d disagree: d2t names {ids.numel()} target ids, t2d marks "
                                  f"{mask_ids.numel()}" + ("" if mask_ids.numel() != ids.numel() else
                                                           ", not the same ones"),
                                  "the two maps must describe one vocabulary; re-export the draft")
    return ids


def d2t_from_ids(ids: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """The index map -> (d2t [K] int64, t2d [V] bool)."""
    d2t = (ids - torch.arange(ids.numel(), dtype=torch.int64)).contiguous()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def is_identity(ids: Tensor, vocab: int) -> bool:
    return ids.numel() == vocab and bool((ids == torch.arange(vocab)).all())


def expand(tensors: dict[str, Tensor], vocab: int) -> dict[str, Tensor]:
    """A reduced draft's tensors at full vocabulary: W2 gets zero rows outside the subset and the
    map and the head's K rows go (the target's full head is borrowed). A change: tokens outside the
    subset now get the head's own logits, so acceptance must be measured again."""
    ids = tensors["draft_vocab_ids"]
    out = {k: v for k, v in tensors.items() if k not in ("draft_vocab_ids", "lm_head.weight")}
    if W2 in tensors:
        w2 = tensors[W2]
        full = torch.zeros(vocab, w2.shape[1], dtype=w2.dtype)
        full[ids] = w2
        out[W2] = full
    return out
