"""The training loop: many anchors per sequence in one draft forward, AdamW, exact resume.

Run folder (outside the repo; `runs_dir/<recipe name>-<recipe hash>/`):
    checkpoints/step_000100/   draft.safetensors (fp32 trainable tensors) + state.pt
                               (optimizer, step, sampler generator state; loaded weights_only)
    latest.json                the newest complete checkpoint
    log.jsonl                  one line per logged step (loss parts, lr, seconds by phase)
    final/                     the trained draft in DeepSpec format (bf16, no embed/lm_head)
A checkpoint folder is complete or absent (written atomically), so a killed run resumes at the
last checkpoint and, because batch sampling uses only the saved generator, reproduces the same
batches and parameters as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.errors import InputError, option
from dsparkctl.fsutil import append_line, atomic_dir, full_disk_error, write_json
from dsparkctl.strict_json import finite
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.train.data import Sequence
from dsparkctl.distributed import all_reduce_sum_, world
from dsparkctl.train.loss import LossParts, dspark_loss, loss_counts, lr_at
from dsparkctl.train.recipe import Recipe


@dataclass
class Batch:
    features: torch.Tensor  # [B, S, F] float32 (zero padded), already scaled by the tap scales
    anchor_ids: torch.Tensor  # [B, N]
    anchor_pos: torch.Tensor  # [B, N]
    prev_tokens: torch.Tensor  # [B, N, γ]  (anchor, x*_1..x*_{γ-1})
    target_idx: torch.Tensor  # [B, N, γ]  draft-vocabulary index of x*_1..x*_γ (-1: not emittable)
    topk_idx: torch.Tensor  # [B, N, γ, k] draft-vocabulary index of the target's top-k (-1: outside)
    topk_p: torch.Tensor  # [B, N, γ, k] float32 target probabilities of those ids
    valid: torch.Tensor  # [B, N, γ] bool

    def to(self, device: torch.device) -> "Batch":
        return Batch(**{k: v.to(device, non_blocking=True) for k, v in self.__dict__.items()})


def anchor_range(seq: Sequence, gamma: int) -> tuple[int, int]:
    """Anchors a with a full block inside the sequence: prompt_len <= a <= S-1-γ (may be empty)."""
    return seq.prompt_len, len(seq.tokens) - 1 - gamma


def sample_anchors(seqs: list[Sequence], n_anchors: int, gamma: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n_anchors distinct full-block anchors per sequence, sorted: (positions [B, N], valid [B, N])."""
    B = len(seqs)
    a_pos = torch.zeros(B, n_anchors, dtype=torch.long)
    ok = torch.zeros(B, n_anchors, dtype=torch.bool)
    for b, s in enumerate(seqs):
        lo, hi = anchor_range(s, gamma)
        count = max(0, hi - lo + 1)
        pick = torch.randperm(count, generator=gen)[:n_anchors] + lo if count else torch.zeros(0, dtype=torch.long)
        a_pos[b, : len(pick)] = torch.sort(pick).values
        ok[b, : len(pick)] = True
        a_pos[b, len(pick):] = lo if count else 0
    return a_pos, ok


def make_batch(seqs: list[Sequence], n_anchors: int, gamma: int, gen: torch.Generator, to_draft: torch.Tensor,
               feature_scale: torch.Tensor | None = None, rows: slice | None = None) -> Batch:
    """Sample anchors for every sequence (the generator advances the same way on every rank), then
    assemble the batch of `rows` (this rank's share; all by default).

    to_draft: [V] long, the draft-vocabulary index of each target id (-1 outside the subset).
    Context is cut at the last sampled anchor (later positions are never attended to)."""
    a_pos, ok = sample_anchors(seqs, n_anchors, gamma, gen)
    if rows is not None:
        seqs, a_pos, ok = seqs[rows], a_pos[rows], ok[rows]
    B = len(seqs)
    S = max(1, int(a_pos.max())) if B else 1
    F_ = seqs[0].features.shape[1]
    k = seqs[0].topk_ids.shape[1]
    feats = torch.zeros(B, S, F_)
    toks = torch.zeros(B, n_anchors, gamma + 1, dtype=torch.long)
    tk_ids = torch.zeros(B, n_anchors, gamma, k, dtype=torch.long)
    tk_lp = torch.full((B, n_anchors, gamma, k), -math.inf)
    steps = torch.arange(gamma + 1)
    for b, s in enumerate(seqs):
        n = min(S, len(s.features))
        feats[b, :n] = s.features[:n].float()
        idx = (a_pos[b][:, None] + steps).clamp(max=len(s.tokens) - 1)  # [N, γ+1]
        toks[b] = s.tokens[idx]
        # slot k predicts the token at a+k; top-k row j holds the target's distribution for the token at P+j
        rows_k = (idx[:, 1:] - s.prompt_len).clamp(0, len(s.topk_ids) - 1)
        tk_ids[b] = s.topk_ids[rows_k].long()
        tk_lp[b] = s.topk_logp[rows_k].float()
    if feature_scale is not None:
        feats *= feature_scale
    valid = ok[:, :, None].expand(B, n_anchors, gamma).clone()
    return Batch(features=feats, anchor_ids=toks[:, :, 0], anchor_pos=a_pos, prev_tokens=toks[:, :, :gamma],
                 target_idx=to_draft[toks[:, :, 1:]], topk_idx=to_draft[tk_ids], topk_p=tk_lp.exp(), valid=valid)


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


# ------------------------------------------------------------------ the run folder, read as untrusted input
STEP_NAME = re.compile(r"step_(\d{6})")


def damaged(file: Path, why: str) -> InputError:
    """The one refusal of a damaged run folder: one line naming the file."""
    run = file.parent.parent.parent if file.parent.parent.name == "checkpoints" else file.parent
    return InputError(f"{file}: {why}; the run folder is damaged",
                      f"delete {run} to start the run over, or train into another {option('cache_dir')}")


def checkpoint_folders(run_dir: Path) -> list[tuple[Path, int]]:
    """(folder, step) of every checkpoint folder named as we name them (`step_NNNNNN`, a real folder)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir() or folder.is_symlink():
        return []
    out = []
    for p in folder.iterdir():
        m = STEP_NAME.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink():
            out.append((p, int(m.group(1))))
    return sorted(out, key=lambda x: x[1])


RUN_FILES = {"latest.json": "file", "log.jsonl": "file", "evals.jsonl": "file", "checkpoints": "folder",
             "final": "folder"}


def check_run_files(run_dir: Path) -> None:
    """Every entry of ours in a run folder is what we write there (a regular file, a real folder),
    never a FIFO a writer would block on, a link leading elsewhere or a device: else `damaged`."""
    import stat

    for name, kind in RUN_FILES.items():
        try:
            st = os.lstat(run_dir / name)
        except OSError:
            continue
        ok = stat.S_ISREG(st.st_mode) if kind == "file" else stat.S_ISDIR(st.st_mode)
        if not ok:
            raise damaged(run_dir / name, f"is not a {'regular file' if kind == 'file' else 'folder'}")


def read_latest(run_dir: Path) -> tuple[int, Path] | None:
    """(step, checkpoint folder) from `latest.json`, or None when the run has none. Refused
    (`damaged`): not a regular file, not strict JSON, not {"step": int >= 0, "path": "step_NNNNNN"}
    with the same step, or a folder that is not a real folder inside `checkpoints/`."""
    from dsparkctl.fsutil import regular_file
    from dsparkctl.strict_json import loads

    latest = run_dir / "latest.json"
    if not os.path.lexists(latest):
        return None
    if not regular_file(latest):
        raise damaged(latest, "is not a regular file")
    try:
        info = loads(latest.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise damaged(latest, f"is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(info, dict) or set(info) != {"step", "path"}:
        raise damaged(latest, 'is not {"step": N, "path": "step_NNNNNN"}')
    step, name = info["step"], info["path"]
    m = STEP_NAME.fullmatch(name) if isinstance(name, str) else None
    if type(step) is not int or step < 0 or m is None or int(m.group(1)) != step:
        raise damaged(latest, f"names step {step!r} and folder {name!r}, which do not agree")
    path = run_dir / "checkpoints" / name
    if path.is_symlink() or not path.is_dir():
        raise damaged(latest, f"names the checkpoint {name}, which is missing or not a folder")
    return step, path


def read_checkpoint_tensors(draft_file: Path, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """A checkpoint's `draft.safetensors`, validated: exactly the draft's trainable tensors, with
    their shapes and dtypes, all finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dsparkctl.fsutil import regular_file

    if not regular_file(draft_file):
        raise damaged(draft_file, "is missing or not a regular file")
    try:
        tensors = load_file(str(draft_file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise damaged(draft_file, f"cannot be read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if set(tensors) != set(params):
        raise damaged(draft_file, "holds other tensors than the draft's")
    for n, p in params.items():
        if tensors[n].shape != p.shape or tensors[n].dtype != p.dtype:
            raise damaged(draft_file, f"tensor {n} is {tuple(tensors[n].shape)} {tensors[n].dtype}, the draft's "
                          f"{tuple(p.shape)} {p.dtype}")
        if not bool(torch.isfinite(tensors[n]).all()):
            raise damaged(draft_file, f"tensor {n} holds NaN or infinity")
    return tensors


def read_checkpoint(path: Path, step: int, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
                    gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, state) of a checkpoint folder, validated: `draft.safetensors` holds exactly the
    draft's trainable tensors with their shapes and dtypes; `state.pt` (weights_only, never
    unpickled) is {step, optimizer, generator, recipe_digest} with this step, a ByteTensor
    generator state and an optimizer state for these parameters with their shapes."""
    from dsparkctl.fsutil import regular_file

    state_file = path / "state.pt"
    if not regular_file(state_file):
        raise damaged(state_file, "is missing or not a regular file")
    tensors = read_checkpoint_tensors(path / "draft.safetensors", params)
    try:
        state = torch.load(state_file, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - a truncated zip, a pickle refused by weights_only, ...
        raise damaged(state_file, f"cannot be read ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})") from None
    if not isinstance(state, dict) or set(state) != {"step", "optimizer", "generator", "recipe_digest"}:
        raise damaged(state_file, "is not a checkpoint state of dsparkctl")
    if type(state["step"]) is not int or state["step"] != step:
        raise damaged(state_file, f"is of step {state['step']!r}, latest.json says {step}")
    g = state["generator"]
    if not isinstance(g, torch.Tensor) or g.dtype != torch.uint8 or g.shape != gen.get_state().shape:
        raise damaged(state_file, "holds no sampler generator state")
    if not isinstance(state["recipe_digest"], str):
        raise damaged(state_file, "holds no recipe digest")
    o = state["optimizer"]
    mine = opt.state_dict()
    if not isinstance(o, dict) or set(o) != {"state", "param_groups"} or not isinstance(o["state"], dict) \
            or not isinstance(o["param_groups"], list) or len(o["param_groups"]) != len(mine["param_groups"]):
        raise damaged(state_file, "holds no optimizer state of this draft")
    shapes = {}
    for group, own in zip(o["param_groups"], mine["param_groups"]):
        if not isinstance(group, dict) or group.get("params") != own["params"]:
            raise damaged(state_file, "holds an optimizer state of another draft")
    by_index = [p for own in mine["param_groups"] for p in own["params"]]
    plist = [p for g_ in opt.param_groups for p in g_["params"]]
    shapes = dict(zip(by_index, (p.shape for p in plist)))
    for i, st in o["state"].items():
        if i not in shapes or not isinstance(st, dict):
            raise damaged(state_file, "holds an optimizer state of another draft")
        for k in ("exp_avg", "exp_avg_sq"):
            t = st.get(k)
            if not isinstance(t, torch.Tensor) or t.shape != shapes[i] or not bool(torch.isfinite(t).all()):
                raise damaged(state_file, f"optimizer {k} of parameter {i} does not fit the draft")
    return tensors, state


def precision_context(precision: str, device: torch.device):
    """The draft's forward under recipe `optim.precision`: bf16 autocast (weights, optimizer and
    loss reductions stay fp32) or plain fp32; `auto` is bf16 on a GPU and fp32 on a CPU."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


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

    # ------------------------------------------------------------------ checkpoints
    def ckpt_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def save_checkpoint(self) -> Path:
        from safetensors.torch import save_file

        path = self.ckpt_dir(self.step)
        if not world().main:  # rank 0 alone writes; every rank holds the same state
            return path
        if path.exists():
            shutil.rmtree(path)
        try:
            with atomic_dir(path) as tmp:
                save_file({n: p.detach().contiguous() for n, p in trainable(self.draft).items()},
                          str(tmp / "draft.safetensors"))
                with open(tmp / "state.pt", "wb") as fh:
                    torch.save({"step": self.step, "optimizer": self.opt.state_dict(),
                                "generator": self.gen.get_state(),
                                "recipe_digest": self.recipe.digest("draft", "optim")}, fh)
        except RuntimeError as exc:  # torch.save on a full disk: "unexpected pos ...", no errno
            full = full_disk_error(exc, self.run_dir)
            if full is None:
                raise
            raise full from exc
        write_json(self.run_dir / "latest.json", {"step": self.step, "path": path.name})
        keep = set(self.recipe.optim.keep_checkpoints) | {self.step}
        for old, step in checkpoint_folders(self.run_dir):  # only names of ours: a stray folder is left alone
            if step not in keep:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def load_latest(self) -> int:
        """Restore the newest checkpoint if any; returns its step (0 when starting fresh). Every
        file is validated like user input (`read_latest`, `read_checkpoint`): a damaged run folder
        is refused in one line naming the file, before anything of this trainer changes."""
        latest = read_latest(self.run_dir)
        if latest is None:
            return 0
        step, path = latest
        tensors, state = read_checkpoint(path, step, trainable(self.draft), self.opt, self.gen)
        if state["recipe_digest"] != self.recipe.digest("draft", "optim"):
            raise InputError(f"{path}: checkpoint was made with a different draft/optim recipe",
                             f"resume with the same recipe, or start a fresh run without {option('resume')}")
        params = trainable(self.draft)
        opt_before = self.opt.state_dict()
        gen_before = self.gen.get_state()
        try:
            self.opt.load_state_dict(state["optimizer"])
            self.gen.set_state(state["generator"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            self.opt.load_state_dict(opt_before)
            self.gen.set_state(gen_before)
            raise damaged(path / "state.pt", f"optimizer or sampler state does not fit this draft "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[n])
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
        weights = tuple(o.loss_weights)
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
            ts = time.perf_counter()
            lr = lr_at(self.step, o.steps, o.lr, o.warmup_steps, o.min_lr_ratio)
            for g in self.opt.param_groups:
                g["lr"] = lr
            pick = torch.randint(len(self.seqs), (o.batch_sequences,), generator=self.gen).tolist()
            batch = make_batch([self.seqs[i] for i in pick], o.anchors_per_sequence, self.draft.block_size,
                               self.gen, self.to_draft, self.feature_scale, rows=share).to(dev)
            t1 = time.perf_counter()
            counts = all_reduce_sum_(loss_counts(batch.target_idx, batch.valid).cpu())  # global denominators
            with autocast:
                parts = batch_loss(self.draft, batch, weights, counts)
            if w.distributed:  # every rank logs the global loss: the sum of the ranks' shares
                g = all_reduce_sum_(torch.tensor([float(parts.total.detach()), parts.ce, parts.l1, parts.bce],
                                                 dtype=torch.float64))
                parts.ce, parts.l1, parts.bce = float(g[1]), float(g[2]), float(g[3])
                loss = float(g[0])
            else:
                loss = float(parts.total.detach())
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"the loss became {loss} at step {self.step + 1}",
                                    "lower optim.lr or check optim.grad_clip; nothing was saved for this step")
            t2 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            parts.total.backward()
            if w.distributed:  # the gradient of the global loss: sum over ranks (what DDP does, unscaled)
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
            self.step += 1
            t4 = time.perf_counter()
            log = StepLog(self.step, loss, parts.ce, parts.l1, parts.bce, lr, parts.overlap,
                          parts.top1, t4 - ts, {"data": t1 - ts, "forward": t2 - t1, "backward": t3 - t2,
                                                "optimizer": t4 - t3}, int(batch.valid[:, :, 0].sum()))
            result.logs.append(log)
            append_line(self.run_dir / "log.jsonl", json.dumps(finite(log.to_json()), allow_nan=False))
            out_of_time = max_seconds is not None and time.perf_counter() - t0 >= max_seconds
            if max_seconds is not None and w.distributed:  # every rank stops at the same step
                out_of_time = bool(all_reduce_sum_(torch.tensor([float(out_of_time)])) > 0)
            if out_of_time:
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
