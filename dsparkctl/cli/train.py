"""`dsparkctl train RECIPE.toml [--resume] [--set key=value ...]`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from dsparkctl.cli.common import Device, DeviceOpt, JsonOpt, err, guarded, out, print_json, show_progress


def register(app: typer.Typer) -> None:
    @app.command("train")
    @guarded
    def train(
        recipe: Annotated[Path, typer.Argument(help="Recipe TOML (see recipes/).")],
        resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest checkpoint.")] = False,
        set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: section.key=value "
                                                       "or key=value (repeatable).")] = None,
        out_dir: Annotated[Path | None, typer.Option("--out", help="Also write the trained draft here.")] = None,
        cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Data cache and runs "
                                                       "(default ~/.cache/dsparkctl/train).")] = None,
        max_steps: Annotated[int | None, typer.Option("--max-steps", help="Stop after this many more steps "
                                                      "(a checkpoint is written; resume later).")] = None,
        max_minutes: Annotated[float | None, typer.Option("--max-minutes", min=0.01, help="Stop after this many "
                                                          "minutes of training (a checkpoint is written; resume "
                                                          "later).")] = None,
        export_step: Annotated[int | None, typer.Option("--export-step", help="Do not train: write the kept "
                                                        "checkpoint of this step as a draft to --out.")] = None,
        device: DeviceOpt = Device.auto,
        with_embeddings: Annotated[bool, typer.Option("--with-embeddings", help="Also write the target's embedding "
                                                      "and LM head into --out (for DeepSpec's eval.py, which does not "
                                                      "borrow them).")] = False,
        json_: JsonOpt = False,
    ) -> None:
        """Train a DSpark/DFlash draft by self-distillation from the target (resumable)."""
        from dsparkctl.models.loading import load_target, resolve_dtype, stop_token_ids
        from dsparkctl.train.recipe import load_recipe
        from dsparkctl.train.run import run_training

        rec = load_recipe(recipe, set_ or [])
        if with_embeddings and out_dir is None:
            from dsparkctl.errors import UsageError
            raise UsageError("--with-embeddings needs --out FOLDER", "e.g. --out my-draft --with-embeddings")
        import torch
        if rec.optim.threads:
            torch.set_num_threads(rec.optim.threads)
        from dsparkctl.models.loading import resolve_device
        dev = resolve_device(device.value)
        lt = load_target(None if rec.target.model == "embedded" else rec.target.model, dev,
                         resolve_dtype(rec.target.dtype, dev), log=lambda s: err.print(s))
        stops = stop_token_ids(lt.tokenizer, lt.model)
        if export_step is not None:
            from dsparkctl.errors import UsageError
            from dsparkctl.train.run import export_checkpoint
            if out_dir is None:
                raise UsageError("--export-step needs --out FOLDER")
            path = export_checkpoint(rec, export_step, model=lt.model, tokenizer=lt.tokenizer, out=out_dir,
                                     stop_ids=stops, cache_dir=cache_dir, with_embeddings=with_embeddings)
            out.print(f"exported step {export_step} of {rec.name} to {path}")
            return
        t0 = time.perf_counter()
        bar = show_progress()

        def on_data(done: int, total: int) -> None:
            el = time.perf_counter() - t0
            eta = el / done * (total - done)
            err.print(f"data: batch {done}/{total}  elapsed {el:.0f}s  eta {eta:.0f}s", highlight=False)

        state: dict = {"first": None, "progress": None, "task": None}
        if bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            state["progress"] = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                         TimeRemainingColumn(), TextColumn("{task.description}"), console=err)

        def on_step(log) -> None:
            now = time.perf_counter()
            if state["first"] is None:
                state["first"] = (log.step - 1, now - log.seconds)
                if state["progress"] is not None:
                    state["progress"].start()
                    state["task"] = state["progress"].add_task("", total=rec.optim.steps, completed=log.step - 1)
            top1 = " ".join(f"{x:.2f}" for x in log.top1)
            text = (f"loss {log.loss:.3f} (ce {log.ce:.3f} l1 {log.l1:.3f} bce {log.bce:.3f})  "
                    f"top-1 [{top1}]  lr {log.lr:.2e}")
            if state["progress"] is not None:
                state["progress"].update(state["task"], completed=log.step, description=text)
                if log.step == rec.optim.steps:
                    state["progress"].stop()
                return
            s0, t_s = state["first"]
            rate = (log.step - s0) / max(now - t_s, 1e-9)
            eta = (rec.optim.steps - log.step) / rate if rate > 0 else 0.0
            if log.step % 10 == 0 or log.step == rec.optim.steps:
                err.print(f"step {log.step}/{rec.optim.steps}  {text}  {log.seconds:.2f}s/step  "
                          f"eta {eta / 60:.1f} min", highlight=False)

        def on_eval(step: int, h: dict) -> None:
            tau = h.get("tau")
            line = f"held-out τ at step {step}: {tau:.3f}" if tau is not None else f"held-out τ at step {step}: -"
            if state["progress"] is not None:
                state["progress"].console.print(line, highlight=False, markup=False)
            else:
                err.print(line, highlight=False, markup=False)

        try:
            res = run_training(rec, model=lt.model, tokenizer=lt.tokenizer, stop_ids=stops, resume=resume,
                               cache_dir=cache_dir, out=out_dir, log=lambda s: err.print(s, markup=False),
                               on_data=on_data, on_step=on_step, stop_after=max_steps, on_eval=on_eval,
                               max_seconds=max_minutes * 60 if max_minutes is not None else None,
                               with_embeddings=with_embeddings)
        finally:
            if state["progress"] is not None:
                state["progress"].stop()
        summary = {"recipe": rec.name, "recipe_hash": rec.digest(), "run_dir": res.run_dir, "draft": res.draft_dir,
                   "steps": res.steps, "resumed_from": res.resumed_from, "train_seconds": round(res.seconds, 1),
                   "train_sequences": res.train_sequences, "heldout_sequences": res.heldout_sequences,
                   "vocab_coverage": res.vocab_coverage,
                   "last_loss": res.last.to_json() if res.last else None, "heldout_teacher_forced": res.heldout}
        if json_:
            print_json(summary)
            return
        h = res.heldout
        out.print(f"trained {rec.name} to step {res.steps} (resumed from {res.resumed_from}) in {res.seconds / 60:.1f} min")
        if res.last:
            out.print(f"last loss {res.last.loss:.3f}: ce {res.last.ce:.3f}  l1 {res.last.l1:.3f}  bce {res.last.bce:.3f}")
        tau = h.get("tau")
        out.print(f"held-out teacher-forced τ (γ={rec.draft.block_size}, T={h['temperature']}): "
                  f"{tau:.3f} over {h['anchors']} anchors" if tau is not None else "held-out τ: no full blocks")
        out.print(f"draft: {res.draft_dir}")
