"""`dsparkctl train RECIPE.toml [--resume] [--set key=value ...]`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from dsparkctl.cli.common import (Device, DeviceOpt, JsonOpt, err, guarded, out, print_json, progress_bar,
                                  show_progress)
from dsparkctl.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command("train", help="Train a DSpark/DFlash draft by self-distillation from the target (resumable).")(train)


class Reporter:
    """Progress to stderr: a bar on a terminal, else a line every 10 steps; data parts and
    held-out evaluations as lines."""

    def __init__(self, steps: int, update: Any, bar: bool):
        self.steps, self.update, self.bar = steps, update, bar
        self.t0 = time.perf_counter()
        self.first: tuple[int, float] | None = None

    def data(self, done: int, total: int) -> None:
        el = time.perf_counter() - self.t0
        err.print(f"data: part {done}/{total}  elapsed {el:.0f}s  eta {el / done * (total - done):.0f}s",
                  highlight=False)

    def step(self, log: Any) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (log.step - 1, now - log.seconds)
        top1 = " ".join(f"{x:.2f}" for x in log.top1)
        text = (f"loss {log.loss:.3f} (ce {log.ce:.3f} l1 {log.l1:.3f} bce {log.bce:.3f})  top-1 [{top1}]  "
                f"lr {log.lr:.2e}")
        if self.bar:
            self.update(log.step, description=text)
        elif log.step % 10 == 0 or log.step == self.steps:
            s0, ts = self.first
            rate = (log.step - s0) / max(now - ts, 1e-9)
            eta = (self.steps - log.step) / rate if rate > 0 else 0.0
            err.print(f"step {log.step}/{self.steps}  {text}  {log.seconds:.2f}s/step  eta {eta / 60:.1f} min",
                      highlight=False)

    def evaluated(self, step: int, h: dict) -> None:
        tau = h.get("tau")
        err.print(f"held-out τ at step {step}: {tau:.3f}" if tau is not None else f"held-out τ at step {step}: -",
                  highlight=False)


@guarded
def train(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML (see recipes/).")],
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest checkpoint.")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: section.key=value "
                                                   "or key=value (repeatable).")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Also write the trained draft here.")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Data cache and runs "
                                                   "(default ~/.cache/dsparkctl/train).")] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", min=1, help="Stop after this many more steps "
                                                  "(a checkpoint is written; resume later).")] = None,
    max_minutes: Annotated[float | None, typer.Option("--max-minutes", min=0.01, help="Stop after this many "
                                                      "minutes of training (a checkpoint is written; resume "
                                                      "later).")] = None,
    export_step: Annotated[int | None, typer.Option("--export-step", min=1, help="Do not train: write the kept "
                                                    "checkpoint of this step as a draft to --out.")] = None,
    device: DeviceOpt = Device.auto,
    with_embeddings: Annotated[bool, typer.Option("--with-embeddings", help="Also write the target's embedding "
                                                  "and LM head into --out (for DeepSpec's eval.py, which does not "
                                                  "borrow them).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Train a DSpark/DFlash draft by self-distillation from the target (resumable)."""
    import torch

    from dsparkctl.engine.session import open_target
    from dsparkctl.train.recipe import load_recipe
    from dsparkctl.train.run import export_checkpoint, run_training

    rec = load_recipe(recipe, set_ or [])
    if (with_embeddings or export_step is not None) and out_dir is None:
        raise UsageError("--with-embeddings and --export-step need --out FOLDER", "e.g. --out my-draft")
    if max_minutes is not None and not max_minutes < float("inf"):
        raise UsageError(f"--max-minutes must be a finite number, got {max_minutes}", "e.g. --max-minutes 30")
    if out_dir is not None:
        from dsparkctl.checks import Output, check_outputs, local_inputs
        from dsparkctl.models.draft_io import check_draft_destination

        check_outputs([Output(out_dir, "--out", "folder")],
                      local_inputs(rec.optim.init_from or None, target=rec.target.model))
        check_draft_destination(out_dir, overwrite=True)  # before the target loads
    if rec.optim.threads:
        torch.set_num_threads(rec.optim.threads)
    sess = open_target(None if rec.target.model == "embedded" else rec.target.model, device.value, rec.target.dtype,
                       log=lambda s: err.print(s, highlight=False))
    lt = sess.target
    if export_step is not None:
        path = export_checkpoint(rec, export_step, model=lt.model, tokenizer=lt.tokenizer, out=out_dir,
                                 stop_ids=sess.stop_ids, cache_dir=cache_dir, with_embeddings=with_embeddings)
        out.print(f"exported step {export_step} of {rec.name} to {path}", highlight=False)
        return
    with progress_bar("train", rec.optim.steps, describe=True) as update:
        rep = Reporter(rec.optim.steps, update, bar=show_progress())
        res = run_training(rec, model=lt.model, tokenizer=lt.tokenizer, stop_ids=sess.stop_ids, resume=resume,
                           cache_dir=cache_dir, out=out_dir, log=lambda s: err.print(s, highlight=False),
                           on_data=rep.data, on_step=rep.step, stop_after=max_steps, on_eval=rep.evaluated,
                           max_seconds=max_minutes * 60 if max_minutes is not None else None,
                           with_embeddings=with_embeddings)
    summary = {"recipe": rec.name, "recipe_hash": rec.digest(), "run_dir": res.run_dir, "draft": res.draft_dir,
               "steps": res.steps, "resumed_from": res.resumed_from, "train_seconds": round(res.seconds, 1),
               "train_sequences": res.train_sequences, "heldout_sequences": res.heldout_sequences,
               "vocab_coverage": res.vocab_coverage,
               "last_loss": res.last.to_json() if res.last else None, "heldout_teacher_forced": res.heldout}
    if json_out:
        print_json(summary)
        return
    h = res.heldout
    out.print(f"trained {rec.name} to step {res.steps} (resumed from {res.resumed_from}) in {res.seconds / 60:.1f} min",
              highlight=False)
    if res.last:
        out.print(f"last loss {res.last.loss:.3f}: ce {res.last.ce:.3f}  l1 {res.last.l1:.3f}  bce {res.last.bce:.3f}")
    tau = h.get("tau")
    out.print(f"held-out teacher-forced τ (γ={rec.draft.block_size}, T={h['temperature']}): {tau:.3f} over "
              f"{h['anchors']} anchors" if tau is not None else "held-out τ: no full blocks")
    out.print(f"draft: {res.draft_dir}", highlight=False)
