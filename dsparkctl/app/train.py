"""`train`: load the recipe and check the options and the draft folder before the target loads, then
train (train/job.py) or export a kept checkpoint, and return the train document.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs, local_inputs
from dsparkctl.checks import check_positive
from dsparkctl.engine.session import open_target
from dsparkctl.errors import UsageError, option
from dsparkctl.locks import wait_limit
from dsparkctl.models.draft_io import check_draft_destination
from dsparkctl.train.draft_init import check_embeddings_export
from dsparkctl.train.job import export_checkpoint, train_draft
from dsparkctl.train.recipe import load_recipe
from dsparkctl.train.trainer import StepLog


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
    loads, then train (`train_draft`) or, with `export_step`, export that kept checkpoint
    (`export_checkpoint`). Returns the train document: the recipe, run folder, draft, steps,
    timing, data, last loss and held-out teacher-forced stats; for an export, the recipe, the
    step and the draft folder written (`exported_step`, `draft`).

    `on_start(steps)`: the recipe's step count, once the target is loaded and training begins."""

    rec = load_recipe(spec.recipe, spec.overrides)
    wait_limit()  # a $DSPARKCTL_LOCK_WAIT_S that is no number is refused now, not when a lock is met
    if (spec.with_embeddings or spec.export_step is not None) and spec.out is None:
        raise UsageError(f"{option('with_embeddings')} and {option('export_step')} need {option('out')} FOLDER",
                         f"e.g. {option('out')} my-draft")
    for name in ("max_steps", "export_step"):  # typer bounds them for the command; this for every caller
        if getattr(spec, name) is not None:
            check_positive(getattr(spec, name), name)
    if spec.max_minutes is not None and not 0 < spec.max_minutes < float("inf"):
        raise UsageError(f"{option('max_minutes')} must be a finite number > 0, got {spec.max_minutes}",
                         f"e.g. {option('max_minutes')} 30")
    outputs = [Output(spec.cache_dir, option("cache_dir"), "folder", whole=False)] if spec.cache_dir is not None else []
    outputs += [Output(spec.out, option("out"), "folder")] if spec.out is not None else []
    check_outputs(outputs, local_inputs(rec.optim.init_from or None, target=rec.target.model))
    if spec.out is not None:
        check_draft_destination(spec.out, overwrite=True)
        check_embeddings_export(rec.draft.vocab_size, spec.with_embeddings)
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
    res = train_draft(rec, model=lt.model, tokenizer=lt.tokenizer, stop_ids=sess.stop_ids, resume=spec.resume,
                       cache_dir=spec.cache_dir, out=spec.out, log=log, on_data=on_data, on_step=on_step,
                       stop_after=spec.max_steps, on_eval=on_eval,
                       max_seconds=spec.max_minutes * 60 if spec.max_minutes is not None else None,
                       with_embeddings=spec.with_embeddings)
    return {"recipe": rec.name, "recipe_hash": rec.digest(), "run_dir": res.run_dir, "draft": res.draft_dir,
            "steps": res.steps, "resumed_from": res.resumed_from, "train_seconds": round(res.seconds, 1),
            "train_sequences": res.train_sequences, "heldout_sequences": res.heldout_sequences,
            "vocab_coverage": res.vocab_coverage,
            "last_loss": res.last.to_json() if res.last else None, "heldout_teacher_forced": res.heldout}
