"""A training job: its run folder and lock, its data and initial draft, the loop, held-out
evaluation and the export of the trained draft.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dsparkctl.distributed import barrier, world
from dsparkctl.errors import InputError, option
from dsparkctl.evaluation.teacher_forced import TeacherForcedStats, anchor_block_logits, beta_from_l1
from dsparkctl.files.cache import cache_root
from dsparkctl.files.atomic import cut_log
from dsparkctl.locks import refuse_if_held, release
from dsparkctl.math.sampling import SamplingParams, warp_probs
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.target import TargetAdapter
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import finite
from dsparkctl.train.batches import anchor_range
from dsparkctl.train.checkpoints import check_run_files, read_checkpoint_tensors, read_latest
from dsparkctl.train.data import build_dataset
from dsparkctl.train.draft_init import (check_against_target, export_draft, init_draft, load_init_draft,
                                        pick_mask_token, select_vocab, tap_scale, vocab_coverage)
from dsparkctl.train.loss import sparse_l1
from dsparkctl.train.parts import Sequence
from dsparkctl.train.recipe import Recipe
from dsparkctl.train.trainer import StepLog, Trainer, trainable


def default_cache_dir() -> Path:
    """`train/` of the cache root (files.cache.cache_root): the data cache and the run folders."""

    return cache_root() / "train"


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir/run.lock` (rank 0; its owner named by pid, start time, boot and host): a
    second run of the same recipe is refused at once, in one line, while this one is alive."""

    lock = run_dir / "run.lock"
    if not world().main:
        yield
        return
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # deepest first
    made = made or [run_dir]  # an existing empty run folder is removed as before
    run_dir.mkdir(parents=True, exist_ok=True)
    refuse_if_held(lock, f"the run folder {run_dir}")
    try:
        yield
    finally:
        release(lock)
        for folder in made:  # a run that left nothing in its folder leaves no folders behind
            with contextlib.suppress(OSError):  # not empty (or not ours to remove): it stays
                folder.rmdir()


def run_dir_for(recipe: Recipe, cache_dir: Path | None = None, runs_dir: Path | None = None) -> Path:
    """The run folder of a recipe: `<runs>/<name>-<hash of the whole recipe>`."""
    return (runs_dir or (cache_dir or default_cache_dir()) / "runs") / f"{recipe.name}-{recipe.digest()}"


# ------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def heldout_stats(draft: DSparkDraft, seqs: list[Sequence], temperature: float,
                  scale: torch.Tensor | None = None, chunk: int = 64):
    """Teacher-forced stats from cached held-out sequences (features and the target's top-k).

    At T = 0 this is exact (β = 1 when the draft's argmax is the target's); at T > 0 the target's
    distribution is its cached top-k (tail mass ignored), so β is approximate there."""

    params = SamplingParams(temperature=temperature)
    g = draft.block_size
    V = draft.cfg.vocab_size
    ids = draft.draft_vocab_ids
    to_draft = torch.full((V,), -1, dtype=torch.long)
    to_draft[ids.cpu() if ids is not None else torch.arange(V)] = torch.arange(draft.cfg.output_vocab_size)
    stats = TeacherForcedStats(block_size=g)
    was_training = draft.training
    draft.eval()
    dev = next(draft.fc.parameters()).device
    for s in seqs:
        lo, hi = anchor_range(s, g)
        if hi < lo:
            continue
        feats = s.features.float()[None]
        if scale is not None:
            feats = feats * scale
        betas = []
        for idx, logits in anchor_block_logits(draft, feats.to(dev), s.tokens, torch.arange(lo, hi + 1), chunk,
                                               trim_context=True):
            logits = logits.float().cpu()
            rows = idx[:, 1:] - s.prompt_len  # top-k row of the token each slot predicts (a+1..a+γ)
            if params.greedy:  # one-hot p and q: β is 1 where the argmaxes agree, else 0
                betas.append((to_draft[s.topk_ids[rows, 0].long()] == logits.argmax(-1)).float())
            else:
                q = warp_probs(logits, params)
                p = warp_probs(s.topk_logp[rows].float(), params)  # warped over the top-k only
                betas.append(beta_from_l1(sparse_l1(q, to_draft[s.topk_ids[rows].long()], p)))
        stats.add(torch.cat(betas))
    draft.train(was_training)
    return stats


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
    vocab_coverage: float | None


def split(recipe: Recipe, seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held-out): the first `eval.holdout` sequences are held out (stable as data grows)."""
    hold = recipe.eval.holdout
    return seqs[hold:], seqs[:hold]


def prepare(recipe: Recipe, model: Any, tokenizer: Any, stop_ids: list[int], cache_dir: Path,
            log: Callable[[str], None], on_data: Callable[[int, int], None] | None):
    """Data, split, the initial draft (vocabulary, tap scale, warm start or init_from)."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = TargetAdapter(model, recipe.draft.layer_ids)  # refuses taps the target does not have
    seqs = build_dataset(recipe, model, tokenizer, stop_ids, cache_dir, log=log, on_batch=on_data,
                         holdout=recipe.eval.holdout)
    train_seqs, held = split(recipe, seqs)
    draft = init_draft(recipe, adapter, pick_mask_token(recipe, tokenizer, adapter.vocab_size))
    if recipe.draft.vocab_size:
        draft.set_draft_vocab(select_vocab(train_seqs, recipe.draft.vocab_size, adapter.vocab_size))
        draft.share_target_embeddings(adapter.embed_tokens(), adapter.lm_head())
    scale = tap_scale(train_seqs, len(recipe.draft.layer_ids)) if recipe.draft.tap_norm else None
    draft.to(adapter.device)
    if recipe.optim.init_from:
        load_init_draft(recipe, draft, adapter, scale, train_seqs)
    return adapter, train_seqs, held, draft, scale


def train_draft(recipe: Recipe, *, model: Any, tokenizer: Any, stop_ids: list[int], resume: bool,
                 cache_dir: Path | None = None, runs_dir: Path | None = None, out: Path | None = None,
                 log: Callable[[str], None] = print, on_data: Callable[[int, int], None] | None = None,
                 on_step: Callable[[StepLog], None] | None = None, stop_after: int | None = None,
                 on_eval: Callable[[int, dict[str, Any]], None] | None = None,
                 max_seconds: float | None = None, with_embeddings: bool = False) -> TrainOutcome:
    if recipe.optim.threads:
        torch.set_num_threads(recipe.optim.threads)
    cache_dir = cache_dir or default_cache_dir()
    run_dir = run_dir_for(recipe, cache_dir, runs_dir)
    check_against_target(recipe, model)
    with run_lock(run_dir):  # two identical runs at once never share one run folder
        if os.path.lexists(run_dir / "latest.json") and not resume:
            raise InputError(f"{run_dir} already holds checkpoints of this recipe",
                             f"pass {option('resume')} to continue it, or delete the folder to start over")
        check_run_files(run_dir)  # a FIFO or link where we append or write would block or lead elsewhere
        if resume:
            read_latest(run_dir)  # a damaged run folder is refused now, not after the data are built
        adapter, train_seqs, held, draft, scale = prepare(recipe, model, tokenizer, stop_ids, cache_dir, log, on_data)
        run_dir.mkdir(parents=True, exist_ok=True)
        coverage = vocab_coverage(held, draft.draft_vocab_ids, adapter.vocab_size)
        trainer = Trainer(recipe, draft, train_seqs, run_dir, feature_scale=scale)
        start = trainer.load_latest() if resume else 0
        for name in ("log.jsonl", "evals.jsonl"):  # the steps after the checkpoint are redone: logged once
            cut_log(run_dir / name, start)
        if start:
            log(f"resumed {run_dir.name} at step {start}")

        def evaluate(step: int) -> None:
            if recipe.eval.every and step % recipe.eval.every == 0 and world().main:
                t = time.perf_counter()
                st = heldout_stats(draft, held, recipe.eval.temperature, scale)
                row = {"step": step, "temperature": recipe.eval.temperature, **st.to_json(),
                       "eval_seconds": round(time.perf_counter() - t, 2)}
                with open(run_dir / "evals.jsonl", "a") as fh:
                    fh.write(json.dumps(finite(row), allow_nan=False) + "\n")
                if on_eval:
                    on_eval(step, row)

        res = trainer.train(on_step=on_step, stop_after=stop_after, on_checkpoint=evaluate, max_seconds=max_seconds)
        heldout: dict[str, Any] = {"temperature": recipe.eval.temperature}
        if world().main:  # rank 0 evaluates and exports; the others wait for it
            stats = heldout_stats(draft, held, recipe.eval.temperature, scale)
            heldout.update(stats.to_json())
            extra = {"dsparkctl": provenance(recipe=recipe.to_dict(), recipe_hash=recipe.digest(), steps=res.steps,
                                             target=recipe.target.model, heldout_tau=stats.tau,
                                             train_sequences=len(train_seqs), vocab_coverage=coverage,
                                             world_size=world().size)}
            export_draft(draft, run_dir / "final", scale, extra)
            if out is not None:
                export_draft(draft, out, scale, extra, with_embeddings)
        barrier()
        return TrainOutcome(run_dir=run_dir, draft_dir=out or run_dir / "final", steps=res.steps, resumed_from=start,
                            seconds=res.seconds, last=res.logs[-1] if res.logs else None, heldout=heldout,
                            train_sequences=len(train_seqs), heldout_sequences=len(held), vocab_coverage=coverage)


def export_checkpoint(recipe: Recipe, step: int, *, model: Any, tokenizer: Any, out: Path, stop_ids: list[int],
                      cache_dir: Path | None = None, runs_dir: Path | None = None,
                      with_embeddings: bool = False) -> Path:
    """Write the kept checkpoint of `step` (see optim.keep_checkpoints) as a DeepSpec draft folder."""

    cache_dir = cache_dir or default_cache_dir()
    run_dir = run_dir_for(recipe, cache_dir, runs_dir)
    check_against_target(recipe, model)
    path = run_dir / "checkpoints" / f"step_{step:06d}" / "draft.safetensors"
    if not path.is_file():
        kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if run_dir.is_dir() else []
        raise InputError(f"no checkpoint for step {step} in {run_dir}",
                         f"kept checkpoints: {', '.join(kept) or 'none'} (list steps in optim.keep_checkpoints)")
    _, _, _, draft, scale = prepare(recipe, model, tokenizer, stop_ids, cache_dir, lambda s: None, None)
    tensors = read_checkpoint_tensors(path, trainable(draft))
    with torch.no_grad():
        for n, p in trainable(draft).items():
            p.copy_(tensors[n])
    extra = {"dsparkctl": provenance(recipe=recipe.to_dict(), recipe_hash=recipe.digest(), steps=step,
                                     target=recipe.target.model, exported_from=str(path))}
    return export_draft(draft, out, scale, extra, with_embeddings)
