"""A draft before and after training: its reduced vocabulary, the scale of its taps, its initial
weights (copied from the target's layers, or another draft), and the draft folder it is exported to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dsparkctl.errors import InputError, option
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.models.draft_io import (check_compatible, init_weights, load_draft, random_draft_config,
                                       read_draft_config, resolve_folder, save_draft)
from dsparkctl.models.target import TargetAdapter
from dsparkctl.train.parts import Sequence
from dsparkctl.train.recipe import Recipe
from dsparkctl.train.trainer import trainable


# ------------------------------------------------------------------------------------ vocabulary
def select_vocab(seqs: list[Sequence], size: int, vocab_size: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent response tokens (ties: lower id), as ascending target ids [K];
    every id of `keep` (a smaller draft's vocabulary being grown) is in it, the rest by frequency."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.tokens[s.prompt_len:], minlength=vocab_size)
    kept = set() if keep is None else set(keep.tolist())
    order = sorted(range(vocab_size), key=lambda t: (t not in kept, -int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def vocab_coverage(seqs: list[Sequence], ids: torch.Tensor | None, vocab_size: int) -> float | None:
    """Share of response tokens (the target's outputs) that the draft vocabulary can emit."""
    if ids is None:
        return 1.0
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    hit = total = 0
    for s in seqs:
        r = s.tokens[s.prompt_len:]
        hit += int(inside[r].sum())
        total += r.numel()
    return hit / total if total else None


def tap_scale(seqs: list[Sequence], n_taps: int, sample: int = 200) -> torch.Tensor:
    """Per-feature multiplier [F] that brings each tapped layer to unit RMS (over a data sample)."""
    rows = torch.cat([s.features[:: max(1, len(s.features) // 16)].float() for s in seqs[:sample]])
    F_ = rows.shape[1]
    per_tap = rows.view(-1, n_taps, F_ // n_taps).pow(2).mean(dim=(0, 2)).sqrt().clamp(min=1e-6)  # [n_taps]
    return (1.0 / per_tap).repeat_interleave(F_ // n_taps)


# ------------------------------------------------------------------------------------ the draft
def init_draft(recipe: Recipe, adapter: TargetAdapter, mask_token_id: int) -> DSparkDraft:
    """A fresh draft shaped by the recipe.

    `draft.init = "random"`: weights N(0, 0.02) from a seeded generator. `"target"`: draft layer
    i starts as target layer L-n+i (attention, MLP and their norms) and the final norm as the
    target's, so the backbone starts as the target's top layers. Either way biases, the Markov
    output projection W2 and the confidence head start at zero: training starts from the plain
    backbone and σ(c) = ½.
    """
    d = recipe.draft
    draft = DSparkDraft(recipe_draft_config(recipe, adapter, mask_token_id))
    init_weights(draft, torch.Generator().manual_seed(recipe.optim.seed), for_training=True)
    if d.init == "target":
        with torch.no_grad():
            copy_target_layers(draft, adapter.model)
    draft.share_target_embeddings(adapter.embed_tokens(), adapter.lm_head())
    return draft.float()


def recipe_draft_config(recipe: Recipe, adapter: TargetAdapter, mask_token_id: int) -> DraftConfig:
    """The config of the draft the recipe's [draft] section describes, for this target."""
    d = recipe.draft
    return random_draft_config(adapter, num_layers=d.num_layers, block_size=d.block_size,
                               markov_rank=d.markov_rank, markov_head_type=d.markov_head_type,
                               confidence=d.confidence, layer_ids=list(d.layer_ids),
                               mask_token_id=mask_token_id, intermediate_size=d.intermediate_size,
                               draft_vocab_size=d.vocab_size)


# Every config field that changes what the draft's tensors mean, with the recipe key that sets it
# (None: the target sets it). Equal shapes are not enough: a block of 5 trained on 4 slots, other
# taps behind the same fc, another mask token embedded in the slots all load and train silently.
INIT_FIELDS = {"block_size": "draft.block_size", "target_layer_ids": "draft.layer_ids",
               "mask_token_id": "draft.mask_token_id", "markov_rank": "draft.markov_rank",
               "markov_head_type": "draft.markov_head_type", "enable_confidence_head": "draft.confidence",
               "num_hidden_layers": "draft.num_layers", "intermediate_size": "draft.intermediate_size",
               "draft_vocab_size": "draft.vocab_size", "vocab_size": None, "hidden_size": None,
               "num_attention_heads": None, "num_key_value_heads": None, "head_dim": None, "qk_norm": None,
               "attention_bias": None, "confidence_head_with_markov": None}


def check_init_source(have: DraftConfig, want: DraftConfig, source: str, skip: tuple[str, ...] = ()) -> None:
    """Refuse an init_from draft (`have`) that differs from the recipe's (`want`) on a field that
    changes what its tensors mean (INIT_FIELDS), shapes aside. A source with fewer layers is
    accepted (`load_init_draft` grows it) unless the caller skips nothing on purpose."""
    if "num_hidden_layers" not in skip and have.num_hidden_layers < want.num_hidden_layers:
        skip = (*skip, "num_hidden_layers")
    for name, key in INIT_FIELDS.items():
        a, b = getattr(have, name), getattr(want, name)
        if name not in skip and a != b:
            shown = (lambda v: list(v) if isinstance(v, tuple) else v)
            raise InputError(f"{source}: its {name} is {shown(a)!r}, the recipe's draft has {shown(b)!r}",
                             f"set {key} = {json.dumps(shown(a))} to continue that draft, or start from one "
                             f"trained with this [draft] section" if key else
                             "start from a draft of this target's shape")


def copy_target_layers(draft: DSparkDraft, model: Any) -> None:
    """Warm start: draft layer i <- target layer L-n+i, draft norm <- target final norm."""
    layers = model.model.layers
    n, L = len(draft.layers), len(layers)
    for i, dl in enumerate(draft.layers):
        src = layers[L - n + i].state_dict()
        own = dl.state_dict()
        for k, v in src.items():
            if k in own and own[k].shape == v.shape:
                own[k].copy_(v)
            elif k in own:
                raise InputError(f"draft.init = target: layer tensor {k} has shape {tuple(own[k].shape)} in the "
                                 f"draft, {tuple(v.shape)} in the target",
                                 "use draft.init = random, or the target's intermediate_size")
    draft.norm.weight.copy_(model.model.norm.weight)


# A layer's two writes to the residual stream (and their biases, where the target has them):
# zeroed, the layer adds nothing to it.
GROWN_ZEROS = (".self_attn.o_proj.weight", ".self_attn.o_proj.bias", ".mlp.down_proj.weight", ".mlp.down_proj.bias")


def _layer_index(name: str) -> int:
    """i of a `layers.i.*` tensor name; -1 for tensors outside the layer stack."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() else -1


W2 = "markov_head.markov_w2.weight"  # [K, r]: one row per token the draft can emit


def grows_vocab(have: DraftConfig, want: DraftConfig) -> bool:
    """The source's reduced vocabulary is a strict part of the recipe's (a larger K, or the full one)."""
    return bool(have.draft_vocab_size) and (not want.draft_vocab_size or want.draft_vocab_size > have.draft_vocab_size)


def load_init_draft(recipe: Recipe, draft: DSparkDraft, adapter: TargetAdapter,
                    scale: torch.Tensor | None, seqs: list[Sequence] | None = None) -> None:
    """Start from a draft folder (`optim.init_from`) of the same shape, or fewer layers, or a
    smaller vocabulary; fc is unfolded by `scale`.

    A source with fewer layers grows: its layers become the first ones, and each new layer keeps
    its fresh weights (`draft.init`) with its attention and MLP output projections zeroed, so the
    grown draft starts computing exactly what the source did and training only adds to it.
    A source with a smaller reduced vocabulary grows too: the recipe's K ids are the source's plus
    the most frequent other tokens of `seqs` (or every token, for K = 0); the source's Markov rows
    W2 go to their tokens and the new tokens' rows start at zero, so over the source's tokens the
    grown draft's logits are exactly the source's."""
    src = load_draft(recipe.optim.init_from, adapter, dtype=torch.float32, device="cpu")
    grow = grows_vocab(src.cfg, draft.cfg)
    check_init_source(src.cfg, draft.cfg, f"optim.init_from {recipe.optim.init_from}",
                      skip=("draft_vocab_size",) if grow else ())
    kept = src.cfg.num_hidden_layers
    mine, theirs = trainable(draft), dict(src.named_parameters())
    new = {n for n in mine if _layer_index(n) >= kept}
    if grow:
        _grow_vocab(draft, src, adapter, seqs or [])
        new.add(W2)  # placed row by row by _grow_vocab, not copied whole
    for n, p in mine.items():
        if n not in new and (n not in theirs or theirs[n].shape != p.shape):
            raise InputError(f"optim.init_from {recipe.optim.init_from}: tensor {n} does not match the recipe's "
                             "draft", "use a draft trained with the same [draft] section")
    with torch.no_grad():
        for n, p in mine.items():
            if n not in new:
                p.copy_(theirs[n])
            elif n.endswith(GROWN_ZEROS):
                p.zero_()  # a grown layer starts as the identity on the residual stream
        if scale is not None:
            draft.fc.weight.div_(scale.to(draft.fc.weight.device))  # exported fc = trained fc · scale: undo the fold
        if draft.draft_vocab_ids is not None and not grow:
            if src.draft_vocab_ids is None:
                raise InputError(f"optim.init_from {recipe.optim.init_from}: has the full vocabulary, the recipe "
                                 "a reduced one", "set draft.vocab_size = 0")
            draft.set_draft_vocab(src.draft_vocab_ids)
            draft.share_target_embeddings(adapter.embed_tokens(), adapter.lm_head())


def _grow_vocab(draft: DSparkDraft, src: DSparkDraft, adapter: TargetAdapter, seqs: list[Sequence]) -> None:
    """The recipe's vocabulary around the source's (see `load_init_draft`), its W2 rows placed."""
    old_ids = src.draft_vocab_ids.cpu()
    if draft.draft_vocab_ids is not None:
        draft.set_draft_vocab(select_vocab(seqs, draft.cfg.draft_vocab_size, adapter.vocab_size, keep=old_ids))
        draft.share_target_embeddings(adapter.embed_tokens(), adapter.lm_head())
    ids = draft.draft_vocab_ids.cpu() if draft.draft_vocab_ids is not None else torch.arange(adapter.vocab_size)
    if draft.markov_head is None:
        return
    rows = torch.searchsorted(ids, old_ids)  # both ascending, and ids ⊇ old_ids
    with torch.no_grad():
        w2 = draft.markov_head.markov_w2.weight
        w2.zero_()
        w2[rows.to(w2.device)] = src.markov_head.markov_w2.weight.to(w2)


def check_embeddings_export(draft_vocab_size: int, with_embeddings: bool) -> None:
    if with_embeddings and draft_vocab_size:
        raise InputError(f"{option('with_embeddings')} writes a DeepSpec draft for loaders that do not borrow the "
                         "target's embedding and LM head; a reduced-vocabulary draft is not one of those",
                         "train with draft.vocab_size = 0 for DeepSpec's eval.py, or drop "
                         f"{option('with_embeddings')}")


def export_draft(draft: DSparkDraft, out: Path, scale: torch.Tensor | None, extra: dict[str, Any],
                 with_embeddings: bool = False) -> Path:
    """Save in DeepSpec format with the tap scale folded into fc (the file needs no extra op).

    `with_embeddings` also writes the (borrowed) embedding and LM head, for loaders such as
    DeepSpec's eval.py that build the draft with from_pretrained and do not borrow them (the
    command checked that they can be written: `check_embeddings_export`)."""
    w = draft.fc.weight.data
    if scale is not None:
        draft.fc.weight.data = w * scale.to(w.device)[None, :]
    try:
        return save_draft(draft, out, dtype=torch.bfloat16, extra_config=extra, overwrite=True,
                          include_embeddings=with_embeddings)
    finally:
        draft.fc.weight.data = w


def pick_mask_token(recipe: Recipe, tokenizer: Any, vocab: int) -> int:
    if recipe.draft.mask_token_id is not None:
        m = int(recipe.draft.mask_token_id)
        if not 0 <= m < vocab:
            raise InputError(f"draft.mask_token_id {m} is outside the vocabulary (size {vocab})",
                             f"use a token id below {vocab}, or leave draft.mask_token_id unset")
        return m
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def check_against_target(recipe: Recipe, model: Any) -> None:
    """What the recipe asks of the target, checked before any data is built (init_from included:
    a draft of another target is refused now, not after the data parts were regenerated)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    if recipe.optim.init_from:

        src = recipe.optim.init_from
        cfg = read_draft_config(resolve_folder(src), f"optim.init_from {src}")
        check_compatible(cfg, TargetAdapter(model), f"optim.init_from {src}")
        want_k = recipe.draft.vocab_size
        if cfg.draft_vocab_size and want_k and want_k < cfg.draft_vocab_size or not cfg.draft_vocab_size and want_k:
            raise InputError(f"optim.init_from {src}: its vocabulary ({cfg.draft_vocab_size or 'full'}) is larger "
                             f"than the recipe's draft.vocab_size ({want_k}): a vocabulary can grow, not shrink",
                             f"set draft.vocab_size to {cfg.draft_vocab_size} or more (0 = the full vocabulary)"
                             if cfg.draft_vocab_size else "set draft.vocab_size = 0 (the full vocabulary)")
        mask = recipe.draft.mask_token_id  # None: the tokenizer's pad token, checked when the draft is built
        want = recipe_draft_config(recipe, TargetAdapter(model), cfg.mask_token_id if mask is None else mask)
        check_init_source(cfg, want, f"optim.init_from {src}", skip=("draft_vocab_size",) if grows_vocab(cfg, want) else ())
    if recipe.draft.vocab_size > vocab:
        raise InputError(f"draft.vocab_size {recipe.draft.vocab_size} exceeds the target's vocabulary ({vocab})",
                         "use a smaller K, or 0 for the full vocabulary")
    if recipe.draft.mask_token_id is not None and not 0 <= recipe.draft.mask_token_id < vocab:
        raise InputError(f"draft.mask_token_id {recipe.draft.mask_token_id} is outside the target's vocabulary "
                         f"({vocab})", "use a special token id of the target's tokenizer")
