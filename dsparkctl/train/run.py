"""`train` as a library call: load the target, build data, train, save, report held-out τ."""

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
from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_io import check_draft_destination, init_weights, load_draft, random_draft_config, save_draft
from dsparkctl.models.target import TargetAdapter
from dsparkctl.provenance import provenance
from dsparkctl.strict_json import finite
from dsparkctl.train.data import Sequence, build_dataset
from dsparkctl.train.recipe import Recipe
from dsparkctl.train.trainer import (StepLog, Trainer, anchor_range, check_run_files, read_checkpoint_tensors,
                                     read_latest, trainable)


def default_cache_dir() -> Path:
    """`train/` of the cache root (fsutil.cache_root): the data cache and the run folders."""
    from dsparkctl.fsutil import cache_root

    return cache_root() / "train"


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir/run.lock` (rank 0; its owner named by pid, start time, boot and host): a
    second run of the same recipe is refused at once, in one line, while this one is alive."""
    from dsparkctl.locks import refuse_if_held, release

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


# ------------------------------------------------------------------------------------ vocabulary
def select_vocab(seqs: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent response tokens (ties: lower id), as ascending target ids [K]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.tokens[s.prompt_len:], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
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
    cfg = random_draft_config(adapter, num_layers=d.num_layers, block_size=d.block_size,
                              markov_rank=d.markov_rank, markov_head_type=d.markov_head_type,
                              confidence=d.confidence, layer_ids=list(d.layer_ids),
                              mask_token_id=mask_token_id, intermediate_size=d.intermediate_size,
                              draft_vocab_size=d.vocab_size)
    draft = DSparkDraft(cfg)
    init_weights(draft, torch.Generator().manual_seed(recipe.optim.seed), for_training=True)
    if d.init == "target":
        with torch.no_grad():
            copy_target_layers(draft, adapter.model)
    draft.share_target_embeddings(adapter.embed_tokens(), adapter.lm_head())
    return draft.float()


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


def load_init_draft(recipe: Recipe, draft: DSparkDraft, adapter: TargetAdapter,
                    scale: torch.Tensor | None) -> None:
    """Start from a draft folder (`optim.init_from`) of the same shape; fc is unfolded by `scale`."""
    src = load_draft(recipe.optim.init_from, adapter, dtype=torch.float32, device="cpu")
    mine, theirs = trainable(draft), dict(src.named_parameters())
    for n, p in mine.items():
        if n not in theirs or theirs[n].shape != p.shape:
            raise InputError(f"optim.init_from {recipe.optim.init_from}: tensor {n} does not match the recipe's "
                             "draft", "use a draft trained with the same [draft] section")
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(theirs[n])
        if scale is not None:
            draft.fc.weight.div_(scale.to(draft.fc.weight.device))  # exported fc = trained fc · scale: undo the fold
        if draft.draft_vocab_ids is not None:
            if src.draft_vocab_ids is None:
                raise InputError(f"optim.init_from {recipe.optim.init_from}: has the full vocabulary, the recipe "
                                 "a reduced one", "set draft.vocab_size = 0")
            draft.set_draft_vocab(src.draft_vocab_ids)
            draft.share_target_embeddings(adapter.embed_tokens(), adapter.lm_head())


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
    DeepSpec's eval.py that build the draft with from_pretrained and do not borrow them."""
    check_embeddings_export(draft.cfg.draft_vocab_size, with_embeddings)
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
            raise InputError(f"draft.mask_token_id {m} is outside the vocabulary (size {vocab})")
        return m
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


# ------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def heldout_stats(draft: DSparkDraft, seqs: list[Sequence], temperature: float,
                  scale: torch.Tensor | None = None, chunk: int = 64):
    """Teacher-forced stats from cached held-out sequences (features and the target's top-k).

    At T = 0 this is exact (β = 1 when the draft's argmax is the target's); at T > 0 the target's
    distribution is its cached top-k (tail mass ignored), so β is approximate there."""
    from dsparkctl.evaluation.teacher_forced import TeacherForcedStats
    from dsparkctl.math.sampling import SamplingParams, warp_probs
    from dsparkctl.train.loss import sparse_l1

    params = SamplingParams(temperature=temperature)
    g = draft.block_size
    V = draft.cfg.vocab_size
    ids = draft.draft_vocab_ids
    to_draft = torch.full((V,), -1, dtype=torch.long)
    to_draft[ids.cpu() if ids is not None else torch.arange(V)] = torch.arange(draft.cfg.output_vocab_size)
    stats = TeacherForcedStats(block_size=g)
    was_training = draft.training
    draft.eval()
    for s in seqs:
        lo, hi = anchor_range(s, g)
        if hi < lo:
            continue
        dev = next(draft.fc.parameters()).device
        feats = s.features.float()[None]
        if scale is not None:
            feats = feats * scale
        feats = feats.to(dev)
        betas = []
        for a0 in range(lo, hi + 1, chunk):
            a = torch.arange(a0, min(hi + 1, a0 + chunk))
            idx = a[:, None] + torch.arange(g + 1)
            toks = s.tokens[idx]
            hidden = draft.forward_blocks(feats[:, : int(a.max())], toks[None, :, 0].to(dev), a[None].to(dev))[0]
            logits, _ = draft.block_logits(hidden, toks[:, :g].to(dev))  # [n, γ, K]
            logits = logits.float().cpu()
            rows = idx[:, 1:] - s.prompt_len  # top-k row of the token each slot predicts (a+1..a+γ)
            if params.greedy:
                betas.append((to_draft[s.topk_ids[rows, 0].long()] == logits.argmax(-1)).float())
            else:
                q = warp_probs(logits, params)
                p = warp_probs(s.topk_logp[rows].float(), params)  # warped over the top-k only
                betas.append((1 - 0.5 * sparse_l1(q, to_draft[s.topk_ids[rows].long()], p)).clamp(0, 1))
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
        load_init_draft(recipe, draft, adapter, scale)
    return adapter, train_seqs, held, draft, scale


def check_against_target(recipe: Recipe, model: Any) -> None:
    """What the recipe asks of the target, checked before any data is built (init_from included:
    a draft of another target is refused now, not after the data parts were regenerated)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    if recipe.optim.init_from:
        from dsparkctl.models.draft_io import read_draft_config, resolve_folder
        from dsparkctl.models.draft_io import check_compatible

        src = recipe.optim.init_from
        cfg = read_draft_config(resolve_folder(src), f"optim.init_from {src}")
        check_compatible(cfg, TargetAdapter(model), f"optim.init_from {src}")
        if bool(cfg.draft_vocab_size) != bool(recipe.draft.vocab_size):
            raise InputError(f"optim.init_from {src}: has {'a reduced' if cfg.draft_vocab_size else 'the full'} "
                             f"vocabulary, the recipe {'a reduced' if recipe.draft.vocab_size else 'the full'} one",
                             "set draft.vocab_size to match the draft you start from")
    if recipe.draft.vocab_size > vocab:
        raise InputError(f"draft.vocab_size {recipe.draft.vocab_size} exceeds the target's vocabulary ({vocab})",
                         "use a smaller K, or 0 for the full vocabulary")
    if recipe.draft.mask_token_id is not None and not 0 <= recipe.draft.mask_token_id < vocab:
        raise InputError(f"draft.mask_token_id {recipe.draft.mask_token_id} is outside the target's vocabulary "
                         f"({vocab})", "use a special token id of the target's tokenizer")


def run_training(recipe: Recipe, *, model: Any, tokenizer: Any, stop_ids: list[int], resume: bool,
                 cache_dir: Path | None = None, runs_dir: Path | None = None, out: Path | None = None,
                 log: Callable[[str], None] = print, on_data: Callable[[int, int], None] | None = None,
                 on_step: Callable[[StepLog], None] | None = None, stop_after: int | None = None,
                 on_eval: Callable[[int, dict[str, Any]], None] | None = None,
                 max_seconds: float | None = None, with_embeddings: bool = False) -> TrainOutcome:
    if recipe.optim.threads:
        torch.set_num_threads(recipe.optim.threads)
    cache_dir = cache_dir or default_cache_dir()
    run_dir = run_dir_for(recipe, cache_dir, runs_dir)
    if out is not None:
        check_draft_destination(out, overwrite=True)  # fail now, not after the training
        check_embeddings_export(recipe.draft.vocab_size, with_embeddings)
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
    check_draft_destination(out, overwrite=True)
    check_embeddings_export(recipe.draft.vocab_size, with_embeddings)
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


@dataclass(frozen=True)
class TrainSpec:
    """Everything `train` runs, as the user gave it (`run_train` checks it)."""
    recipe: Path | None = None  # recipe TOML; None: the defaults (train/recipe.py)
    overrides: tuple[str, ...] = ()  # recipe keys set on top: "section.key=value" or "key=value"
    resume: bool = False  # continue from the run's latest checkpoint
    out: Path | None = None  # also write the trained draft here (needed by export_step and with_embeddings)
    cache_dir: Path | None = None  # data cache and runs; None: default_cache_dir()
    max_steps: int | None = None  # stop after this many more steps (a checkpoint is written)
    max_minutes: float | None = None  # stop after this many minutes of training (a checkpoint is written)
    export_step: int | None = None  # do not train: write the kept checkpoint of this step as a draft to `out`
    device: str = "auto"
    with_embeddings: bool = False  # also write the target's embedding and LM head into `out` (DeepSpec's eval.py)


def run_train(spec: TrainSpec, *, log: Callable[[str], None] = print,
              on_start: Callable[[int], None] | None = None, on_data: Callable[[int, int], None] | None = None,
              on_step: Callable[[StepLog], None] | None = None,
              on_eval: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Load the recipe and check the spec (options, the draft folder `out`) before the target
    loads, then train (`run_training`) or, with `export_step`, export that kept checkpoint
    (`export_checkpoint`). Returns the train document: the recipe, run folder, draft, steps,
    timing, data, last loss and held-out teacher-forced stats; for an export, the recipe, the
    step and the draft folder written (`exported_step`, `draft`).

    `on_start(steps)`: the recipe's step count, once the target is loaded and training begins."""
    from dsparkctl.checks import Output, check_outputs, check_positive, local_inputs
    from dsparkctl.engine.session import open_target
    from dsparkctl.train.recipe import load_recipe

    rec = load_recipe(spec.recipe, spec.overrides)
    if (spec.with_embeddings or spec.export_step is not None) and spec.out is None:
        raise UsageError(f"{option('with_embeddings')} and {option('export_step')} need {option('out')} FOLDER",
                         f"e.g. {option('out')} my-draft")
    for name in ("max_steps", "export_step"):  # typer bounds them for the command; this for every caller
        if getattr(spec, name) is not None:
            check_positive(getattr(spec, name), name)
    if spec.max_minutes is not None and not 0 < spec.max_minutes < float("inf"):
        raise UsageError(f"{option('max_minutes')} must be a finite number > 0, got {spec.max_minutes}",
                         f"e.g. {option('max_minutes')} 30")
    if spec.cache_dir is not None:  # the data cache and the run folders go here
        check_outputs([Output(spec.cache_dir, option("cache_dir"), "folder")])
    if spec.out is not None:
        check_outputs([Output(spec.out, option("out"), "folder")],
                      local_inputs(rec.optim.init_from or None, target=rec.target.model))
        check_draft_destination(spec.out, overwrite=True)
        check_embeddings_export(rec.draft.vocab_size, spec.with_embeddings)
    if rec.optim.threads:
        torch.set_num_threads(rec.optim.threads)
    sess = open_target(rec.target.model, spec.device, rec.target.dtype,
                       log=log)
    lt = sess.target
    if spec.export_step is not None:
        path = export_checkpoint(rec, spec.export_step, model=lt.model, tokenizer=lt.tokenizer, out=spec.out,
                                 stop_ids=sess.stop_ids, cache_dir=spec.cache_dir,
                                 with_embeddings=spec.with_embeddings)
        return {"recipe": rec.name, "recipe_hash": rec.digest(), "exported_step": spec.export_step, "draft": path}
    if on_start:
        on_start(rec.optim.steps)
    res = run_training(rec, model=lt.model, tokenizer=lt.tokenizer, stop_ids=sess.stop_ids, resume=spec.resume,
                       cache_dir=spec.cache_dir, out=spec.out, log=log, on_data=on_data, on_step=on_step,
                       stop_after=spec.max_steps, on_eval=on_eval,
                       max_seconds=spec.max_minutes * 60 if spec.max_minutes is not None else None,
                       with_embeddings=spec.with_embeddings)
    return {"recipe": rec.name, "recipe_hash": rec.digest(), "run_dir": res.run_dir, "draft": res.draft_dir,
            "steps": res.steps, "resumed_from": res.resumed_from, "train_seconds": round(res.seconds, 1),
            "train_sequences": res.train_sequences, "heldout_sequences": res.heldout_sequences,
            "vocab_coverage": res.vocab_coverage,
            "last_loss": res.last.to_json() if res.last else None, "heldout_teacher_forced": res.heldout}
