"""The training loop: many anchors per sequence in one draft forward, AdamW, exact resume.

Each step samples a batch (train/batches.py), runs the draft over it under the recipe's
precision, and takes one AdamW step; under torchrun every rank computes its share of the global
batch and the loss and gradients are summed over ranks. The run folder and its checkpoints are
train/checkpoints.py: because batch sampling uses only the saved generator, a run resumed at its
last checkpoint reproduces the same batches and parameters as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.distributed import all_reduce_sum_, world
from dsparkctl.errors import InputError
from dsparkctl.files.atomic import append_line
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.strict_json import finite
from dsparkctl.train.batches import Batch, anchor_range, make_batch
from dsparkctl.train.checkpoints import restore_latest, write_checkpoint
from dsparkctl.train.loss import LossParts, dspark_loss, loss_counts, lr_at
from dsparkctl.train.parts import Sequence
from dsparkctl.train.recipe import Recipe


def batch_loss(draft: DSparkDraft, batch: Batch, weights: tuple[float, float, float],
               counts: torch.Tensor | None = None) -> LossParts:
    """counts: the loss's denominators over the whole (global) batch, see `loss_counts`."""
    hidden = draft.forward_blocks(batch.features, batch.anchor_ids, batch.anchor_pos)  # [B, N, γ, H]
    logits, conf = draft.block_logits(hidden, batch.prev_tokens)  # [B, N, γ, K], [B, N, γ]
    g, K = logits.shape[-2:]
    k = batch.topk_idx.shape[-1]
    return dspark_loss(logits.reshape(-1, g, K), batch.topk_idx.reshape(-1, g, k), batch.topk_p.reshape(-1, g, k),
                       batch.target_idx.reshape(-1, g), conf.reshape(-1, g) if conf is not None else None,
                       batch.valid.reshape(-1, g), weights, counts=counts)


def trainable(draft: DSparkDraft) -> dict[str, torch.nn.Parameter]:
    """Everything but the borrowed, frozen embedding and LM head."""
    return {n: p for n, p in draft.named_parameters() if not n.startswith(("embed_tokens.", "lm_head."))}


@dataclass
class StepLog:
    step: int
    loss: float
    ce: float
    l1: float
    bce: float
    lr: float
    overlap: list[float]
    top1: list[float]
    seconds: float
    phases: dict[str, float]  # seconds: data, forward, backward, optimizer
    blocks: int  # blocks (anchors) trained on in this step

    def to_json(self) -> dict[str, Any]:
        def r(v: Any) -> Any:
            if isinstance(v, float):
                return round(v, 5) if math.isfinite(v) else None
            if isinstance(v, list):
                return [r(x) for x in v]
            if isinstance(v, dict):
                return {k: r(x) for k, x in v.items()}
            return v
        return {k: r(v) for k, v in self.__dict__.items()}


@dataclass
class TrainResult:
    steps: int
    resumed_from: int
    logs: list[StepLog] = field(default_factory=list)
    seconds: float = 0.0


class NonFiniteLoss(InputError):
    pass


def precision_context(precision: str, device: torch.device):
    """The draft's forward under recipe `optim.precision`: bf16 autocast (weights, optimizer and
    loss reductions stay fp32) or plain fp32; `auto` is bf16 on a GPU and fp32 on a CPU."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def global_loss(parts: LossParts) -> float:
    """The loss every rank logs: under torchrun the global one, the sum of the ranks' shares (the
    parts' ce, l1 and bce summed in place too); else this process's."""
    if not world().distributed:
        return float(parts.total.detach())
    g = all_reduce_sum_(torch.tensor([float(parts.total.detach()), parts.ce, parts.l1, parts.bce],
                                     dtype=torch.float64))
    parts.ce, parts.l1, parts.bce = float(g[1]), float(g[2]), float(g[3])
    return float(g[0])


def out_of_time(t0: float, max_seconds: float | None) -> bool:
    """Have max_seconds passed since t0? Under torchrun decided for every rank alike (any rank's
    clock stops them all at the same step)."""
    out = max_seconds is not None and time.perf_counter() - t0 >= max_seconds
    if max_seconds is not None and world().distributed:  # every rank stops at the same step
        out = bool(all_reduce_sum_(torch.tensor([float(out)])) > 0)
    return out


class Trainer:
    def __init__(self, recipe: Recipe, draft: DSparkDraft, train_seqs: list[Sequence], run_dir: Path,
                 feature_scale: torch.Tensor | None = None):
        g = draft.block_size
        usable = [s for s in train_seqs if anchor_range(s, g)[1] >= anchor_range(s, g)[0]]
        if not usable:
            raise InputError("no training sequence is long enough for one block",
                             "raise data.max_new_tokens or lower draft.block_size")
        self.recipe, self.draft, self.seqs, self.run_dir = recipe, draft, usable, Path(run_dir)
        self.feature_scale = feature_scale
        V = draft.cfg.vocab_size
        self.to_draft = torch.full((V,), -1, dtype=torch.long)
        ids = draft.draft_vocab_ids.cpu() if draft.draft_vocab_ids is not None else torch.arange(V)
        self.to_draft[ids] = torch.arange(ids.numel())
        for n, p in draft.named_parameters():
            p.requires_grad_(n in trainable(draft))
        o = recipe.optim
        w = world()
        if o.batch_sequences % w.size:
            raise InputError(f"optim.batch_sequences {o.batch_sequences} is not divisible by the {w.size} ranks",
                             "the recipe's batch is global: use a multiple of the number of ranks")
        params = list(trainable(draft).values())
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=o.betas,
                                     fused=True)  # one kernel over all tensors: 5x faster than the loop on a CPU
        self.gen = torch.Generator().manual_seed(o.seed)
        self.step = 0

    # ------------------------------------------------------------------ checkpoints (train/checkpoints.py)
    def save_checkpoint(self) -> Path:
        return write_checkpoint(self.run_dir, self.step, trainable(self.draft), self.opt, self.gen,
                                self.recipe.digest("draft", "optim"), self.recipe.optim.keep_checkpoints)

    def load_latest(self) -> int:
        """Restore the newest checkpoint if any; returns its step (0 when starting fresh). A damaged
        run folder is refused in one line naming the file, before anything of this trainer changes."""
        step = restore_latest(self.run_dir, trainable(self.draft), self.opt, self.gen,
                              self.recipe.digest("draft", "optim"))
        if step is None:
            return 0
        self.step = step
        return self.step

    # ------------------------------------------------------------------ loop
    def train(self, on_step: Callable[[StepLog], None] | None = None, stop_after: int | None = None,
              on_checkpoint: Callable[[int], None] | None = None,
              max_seconds: float | None = None) -> TrainResult:
        """Run to recipe.optim.steps (or stop_after more steps, or until max_seconds of training
        have passed: the step in progress finishes and is checkpointed); checkpoint every
        checkpoint_every."""
        o = self.recipe.optim
        result = TrainResult(steps=self.step, resumed_from=self.step)
        t0 = time.perf_counter()
        end = o.steps if stop_after is None else min(o.steps, self.step + stop_after)
        params = list(trainable(self.draft).values())
        w = world()
        per = o.batch_sequences // w.size
        share = slice(w.rank * per, (w.rank + 1) * per)  # this rank's rows of the global batch
        if w.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        dev = next(self.draft.fc.parameters()).device
        autocast = precision_context(o.precision, dev)
        self.draft.train()
        while self.step < end:
            log = self._step(params, share, dev, autocast)
            result.logs.append(log)
            append_line(self.run_dir / "log.jsonl", json.dumps(finite(log.to_json()), allow_nan=False))
            if out_of_time(t0, max_seconds):
                end = self.step
            if self.step % o.checkpoint_every == 0 or self.step == end:
                self.save_checkpoint()
                if on_checkpoint:
                    on_checkpoint(self.step)
            if on_step:
                on_step(log)
        self.draft.eval()
        result.steps = self.step
        result.seconds = time.perf_counter() - t0
        return result

    def _step(self, params: list[torch.nn.Parameter], share: slice, dev: torch.device,
              autocast: Any) -> StepLog:
        """One optimizer step on a fresh batch, of which this rank computes the rows `share`."""
        o = self.recipe.optim
        ts = time.perf_counter()
        lr = lr_at(self.step, o.steps, o.lr, o.warmup_steps, o.min_lr_ratio)
        for g in self.opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(len(self.seqs), (o.batch_sequences,), generator=self.gen).tolist()
        batch = make_batch([self.seqs[i] for i in pick], o.anchors_per_sequence, self.draft.block_size,
                           self.gen, self.to_draft, self.feature_scale, rows=share).to(dev)
        if o.ce_label == "target":  # x* = the target's argmax (top-k is sorted): what greedy verification accepts
            batch.target_idx = batch.topk_idx[..., 0]
        t1 = time.perf_counter()
        counts = all_reduce_sum_(loss_counts(batch.target_idx, batch.valid).cpu())  # global denominators
        with autocast:
            parts = batch_loss(self.draft, batch, tuple(o.loss_weights), counts)
        loss = global_loss(parts)
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"the loss became {loss} at step {self.step + 1}",
                                "lower optim.lr or check optim.grad_clip; nothing was saved for this step")
        t2 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        parts.total.backward()
        if world().distributed:  # the gradient of the global loss: sum over ranks (what DDP does, unscaled)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                all_reduce_sum_(p.grad)
        t3 = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        if not bool(torch.isfinite(norm)):
            raise NonFiniteLoss(f"the gradient became {float(norm)} at step {self.step + 1}",
                                "lower optim.lr; the last checkpoint is intact")
        self.opt.step()
        for m in self.draft.modules():  # inference copies of the weights (fused AdamW bumps no version)
            if hasattr(m, "drop_inference_caches"):
                m.drop_inference_caches()
        self.step += 1
        t4 = time.perf_counter()
        return StepLog(self.step, loss, parts.ce, parts.l1, parts.bce, lr, parts.overlap,
                       parts.top1, t4 - ts, {"data": t1 - ts, "forward": t2 - t1, "backward": t3 - t2,
                                             "optimizer": t4 - t3}, int(batch.valid[:, :, 0].sum()))
