"""`dsparkctl train RECIPE.toml [--resume] [--set key=value ...]`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from dsparkctl.cli.console import err, out, print_json, progress_bar, show_progress
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import Device, DeviceOpt, JsonOpt


def register(app: typer.Typer) -> None:
    app.command("train", help="Train a draft model from a recipe, learning from the target's own outputs "
                "(self-distillation); resumable.")(train)


class Reporter:
    """Progress to stderr: a bar on a terminal, else a line every 10 steps; data parts and
    held-out evaluations as lines."""

    def __init__(self, update: Any, bar: bool):
        self.steps, self.update, self.bar = 0, update, bar
        self.t0 = time.perf_counter()
        self.first: tuple[int, float] | None = None

    def start(self, steps: int) -> None:
        """Training begins (the target is loaded): `steps` in all; the clock starts now."""
        self.steps, self.t0 = steps, time.perf_counter()
        self.update(total=steps)

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


@guarded(fields={"overrides": "set_", "field": "data.field in the recipe",
                 "response_field": "data.response_field in the recipe"})
def train(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML file (examples in the repository's recipes/).")],
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's latest checkpoint.")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key (section.key=value or "
                                                   "key=value); "
                                                   "repeat for several: --set optim.lr=1e-4 --set optim.steps=100."
                                                   )] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Also write the trained draft here.")] = None,
    cache_dir: Annotated[Path | None, typer.Option("--cache-dir", help="Data cache and runs "
                                                   "(default: ~/.cache/dsparkctl/train).")] = None,
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
    from dsparkctl.app.train import TrainSpec, run_train

    spec = TrainSpec(recipe=recipe, overrides=tuple(set_ or ()), resume=resume, out=out_dir, cache_dir=cache_dir,
                     max_steps=max_steps, max_minutes=max_minutes, export_step=export_step, device=device.value,
                     with_embeddings=with_embeddings)
    with progress_bar("train", None, describe=True) as update:
        rep = Reporter(update, bar=show_progress())
        doc = run_train(spec, log=lambda s: err.print(s, highlight=False), on_start=rep.start, on_data=rep.data,
                        on_step=rep.step, on_eval=rep.evaluated)
    if json_out:
        print_json(doc)
    elif "exported_step" in doc:
        out.print(f"exported step {doc['exported_step']} of {doc['recipe']} to {doc['draft']}", highlight=False)
    else:
        print_summary(doc)


def print_summary(doc: dict[str, Any]) -> None:
    """The human view of a training run: steps and time, the last loss, held-out τ, the draft."""
    h, last = doc["heldout_teacher_forced"], doc["last_loss"]
    out.print(f"trained {doc['recipe']} to step {doc['steps']} (resumed from {doc['resumed_from']}) in "
              f"{doc['train_seconds'] / 60:.1f} min", highlight=False)
    if last:
        out.print(f"last loss {last['loss']:.3f}: ce {last['ce']:.3f}  l1 {last['l1']:.3f}  bce {last['bce']:.3f}")
    tau = h.get("tau")
    out.print(f"held-out teacher-forced τ (γ={h['block_size']}, T={h['temperature']}): {tau:.3f} over "
              f"{h['anchors']} anchors" if tau is not None else "held-out τ: no full blocks")
    out.print(f"draft: {doc['draft']}", highlight=False)
