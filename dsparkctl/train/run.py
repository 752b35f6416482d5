"""`train` as a library call: load the target, regenerate data, train, save, report held-out τ."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.errors import InputError
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_io import random_draft_config, save_draft
from dsparkctl.models.target import TargetAdapter
from dsparkctl.provenance import provenance
from dsparkctl.train.data import Sequence, build_dataset
from dsparkctl.train.recipe import Recipe
from dsparkctl.train.trainer import StepLog, Trainer


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsparkctl" / "train"


def init_draft(recipe: Recipe, adapter: TargetAdapter, mask_token_id: int) -> DSparkDraft:
    """A fresh draft shaped by the recipe, weights N(0, 0.02) from a seeded generator.

    The Markov output projection W2 starts at zero, so training starts from the plain backbone
    (the bias grows as W1/W2 learn), and the confidence head starts at σ(0) = ½.
    """
    d = recipe.draft
    cfg = random_draft_config(adapter, num_layers=d.num_layers, block_size=d.block_size,
                              markov_rank=d.markov_rank, markov_head_type=d.markov_head_type,
                              confidence=d.confidence, layer_ids=list(d.layer_ids),
                              mask_token_id=mask_token_id, intermediate_size=d.intermediate_size)
    draft = DSparkDraft(cfg)
    g = torch.Generator().manual_seed(recipe.optim.seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                continue
            if name.endswith(".bias") or name == "markov_head.markov_w2.weight" or name.startswith("confidence_head."):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    draft.share_target_embeddings(adapter.embed_tokens(), adapter.lm_head())
    return draft.float()


def pick_mask_token(recipe: Recipe, tokenizer: Any, vocab: int) -> int:
    if recipe.draft.mask_token_id is not None:
        m = int(recipe.draft.mask_token_id)
        if not 0 <= m < vocab:
            raise InputError(f"draft.mask_token_id {m} is outside the vocabulary (size {vocab})")
        return m
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


@dataclass
class TrainOutcome:
    run_dir: Path
    draft_dir: Path
    steps: int
    resumed_from: int
    seconds: float
    last: StepLog | None
    heldout: dict[str, Any]
    train_sequences: int
    heldout_sequences: int


def heldout_stats(draft: DSparkDraft, seqs: list[Sequence], temperature: float):
    """Teacher-forced stats on cached held-out sequences (features and target final hidden)."""
    from dsparkctl.evaluation.teacher_forced import TeacherForcedStats, sequence_betas
    from dsparkctl.math.sampling import SamplingParams

    params = SamplingParams(temperature=temperature)
    stats = TeacherForcedStats(block_size=draft.block_size)
    head = draft.lm_head
    with torch.no_grad():
        for s in seqs:
            logits = head(s.final.to(head.weight.dtype)).float()
            stats.add(sequence_betas(draft, s.tokens, s.features.float(), logits, s.prompt_len, params))
    return stats


def run_training(recipe: Recipe, *, model: Any, tokenizer: Any, stop_ids: list[int], resume: bool,
                 cache_dir: Path | None = None, runs_dir: Path | None = None, out: Path | None = None,
                 log: Callable[[str], None] = print, on_data: Callable[[int, int], None] | None = None,
                 on_step: Callable[[StepLog], None] | None = None, stop_after: int | None = None) -> TrainOutcome:
    if recipe.optim.threads:
        torch.set_num_threads(recipe.optim.threads)
    cache_dir = cache_dir or default_cache_dir()
    run_dir = (runs_dir or cache_dir / "runs") / f"{recipe.name}-{recipe.digest()}"
    if (run_dir / "latest.json").is_file() and not resume:
        raise InputError(f"{run_dir} already holds checkpoints of this recipe",
                         "pass --resume to continue it, or delete the folder to start over")
    run_dir.mkdir(parents=True, exist_ok=True)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = TargetAdapter(model)
    seqs = build_dataset(recipe, model, tokenizer, stop_ids, cache_dir, log=log, on_batch=on_data)
    hold = recipe.eval.holdout
    train_seqs, held = seqs[:-hold], seqs[-hold:]
    mask = pick_mask_token(recipe, tokenizer, adapter.vocab_size)
    draft = init_draft(recipe, adapter, mask)
    trainer = Trainer(recipe, draft, train_seqs, run_dir)
    start = trainer.load_latest() if resume else 0
    if start:
        log(f"resumed {run_dir.name} at step {start}")
    res = trainer.train(on_step=on_step, stop_after=stop_after)
    stats = heldout_stats(draft, held, recipe.eval.temperature)
    heldout = {"temperature": recipe.eval.temperature, **stats.to_json()}
    extra = {"dsparkctl": provenance(recipe=recipe.to_dict(), recipe_hash=recipe.digest(), steps=res.steps,
                                     target=recipe.target.model, heldout_tau=stats.tau,
                                     train_sequences=len(train_seqs))}
    final = run_dir / "final"
    save_draft(draft, final, dtype=torch.bfloat16, extra_config=extra, overwrite=True)
    if out is not None:
        save_draft(draft, out, dtype=torch.bfloat16, extra_config=extra, overwrite=True)
    return TrainOutcome(run_dir=run_dir, draft_dir=out or final, steps=res.steps, resumed_from=start,
                        seconds=res.seconds, last=res.logs[-1] if res.logs else None, heldout=heldout,
                        train_sequences=len(train_seqs), heldout_sequences=len(held))


def export_checkpoint(recipe: Recipe, step: int, *, model: Any, tokenizer: Any, out: Path,
                      cache_dir: Path | None = None, runs_dir: Path | None = None) -> Path:
    """Write the kept checkpoint of `step` (see optim.keep_checkpoints) as a DeepSpec draft folder."""
    from safetensors.torch import load_file

    cache_dir = cache_dir or default_cache_dir()
    run_dir = (runs_dir or cache_dir / "runs") / f"{recipe.name}-{recipe.digest()}"
    path = run_dir / "checkpoints" / f"step_{step:06d}" / "draft.safetensors"
    if not path.is_file():
        kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if run_dir.is_dir() else []
        raise InputError(f"no checkpoint for step {step} in {run_dir}",
                         f"kept checkpoints: {', '.join(kept) or 'none'} (list steps in optim.keep_checkpoints)")
    adapter = TargetAdapter(model)
    draft = init_draft(recipe, adapter, pick_mask_token(recipe, tokenizer, adapter.vocab_size))
    tensors = load_file(str(path))
    with torch.no_grad():
        for n, p in draft.named_parameters():
            if n in tensors:
                p.copy_(tensors[n])
    extra = {"dsparkctl": provenance(recipe=recipe.to_dict(), recipe_hash=recipe.digest(), steps=step,
                                     target=recipe.target.model, exported_from=str(path))}
    return save_draft(draft, out, dtype=torch.bfloat16, extra_config=extra, overwrite=True)
