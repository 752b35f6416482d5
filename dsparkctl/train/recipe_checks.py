"""The ranges a training recipe's values must keep (`validate`, called by `train.recipe`'s loader)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, NoReturn

from dsparkctl.data.filters import PROMPT_FILTERS
from dsparkctl.errors import CheckpointError, InputError, option
from dsparkctl.models.draft_io import read_draft_config


NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


UPPER_LIMITS = {  # far above any real recipe, far below what would exhaust memory or time
    "draft.num_layers": 256, "draft.block_size": 64, "draft.markov_rank": 1 << 16,
    "draft.intermediate_size": 1 << 20, "draft.vocab_size": 1 << 22,
    "optim.steps": 10 ** 9, "optim.batch_sequences": 1 << 16, "optim.anchors_per_sequence": 1 << 16,
    "optim.threads": 4096, "optim.warmup_steps": 10 ** 9, "optim.checkpoint_every": 10 ** 9, "optim.lr": 10.0,
    "data.num_prompts": 10 ** 8, "data.max_new_tokens": 1 << 20, "data.batch_size": 1 << 16,
    "data.extra_responses": 10 ** 8, "eval.every": 10 ** 9,
}


Refuse = Callable[..., NoReturn]  # bad(message, hint=None): raise the recipe's InputError


def validate(r: Any, source: str) -> None:
    """Refuse a recipe holding a value out of range: one InputError "<source>: <what>", the first
    found, section by section (draft, optim, data and eval), then the upper limits (UPPER_LIMITS),
    then `optim.init_from`, which must be a draft folder whose config reads."""
    def bad(msg: str, hint: str | None = None) -> NoReturn:
        raise InputError(f"{source}: {msg}", hint or f"change that value in the recipe, or override it with "
                         f"{option('overrides')} section.key=value")
    _check_draft(r.draft, bad)
    _check_optim(r.optim, bad)
    if not NAME_RE.fullmatch(r.name):
        bad(f"name {r.name!r} must be letters, digits, '.', '_' or '-' and not start with '.'",
            "it names the run folder, so it cannot hold a path")
    _check_data_and_eval(r, bad)
    if not (0 <= r.optim.seed < 2 ** 32 and 0 <= r.data.seed < 2 ** 32):
        bad(f"optim.seed and data.seed must be in [0, 2**32), got {r.optim.seed}, {r.data.seed}")
    for key, limit in UPPER_LIMITS.items():  # a typo such as 99999999999 is refused here, not by an allocation
        sec, name = key.split(".")
        value = getattr(getattr(r, sec), name)
        if value is not None and value > limit:
            shown = f"(a number of {len(str(value))} digits)" if isinstance(value, int) and value >= 10 ** 24 else f"{value:,}"
            bad(f"{key} {shown} is more than {limit:,}", f"use at most {limit:,}: no draft or run needs more")
    if r.optim.init_from:
        _check_init_from(r.optim.init_from, bad)


def _check_draft(d: Any, bad: Refuse) -> None:
    if d.num_layers < 1:
        bad("draft.num_layers must be >= 1")
    if d.block_size < 1:
        bad("draft.block_size must be >= 1")
    if d.markov_rank < 0:
        bad("draft.markov_rank must be >= 0")
    if d.markov_head_type not in ("vanilla", "gated", "rnn"):
        bad(f"draft.markov_head_type {d.markov_head_type!r}", "use vanilla, gated or rnn")
    if not d.layer_ids or list(d.layer_ids) != sorted(set(d.layer_ids)):
        bad(f"draft.layer_ids must be non-empty and strictly increasing, got {list(d.layer_ids)}")
    if any(i < -1 for i in d.layer_ids):
        bad(f"draft.layer_ids must be >= -1 (-1 = the embeddings), got {list(d.layer_ids)}")
    if d.vocab_size < 0:
        bad("draft.vocab_size must be >= 0 (0 = the full vocabulary)")
    if d.init not in ("random", "target"):
        bad(f"draft.init {d.init!r}", "use random or target")
    if d.intermediate_size is not None and d.intermediate_size < 1:
        bad(f"draft.intermediate_size must be >= 1, got {d.intermediate_size}")
    if d.mask_token_id is not None and d.mask_token_id < 0:
        bad(f"draft.mask_token_id must be >= 0, got {d.mask_token_id}")


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _check_optim(o: Any, bad: Refuse) -> None:
    for name in ("steps", "batch_sequences", "anchors_per_sequence", "checkpoint_every"):
        if getattr(o, name) < 1:
            bad(f"optim.{name} must be >= 1, got {getattr(o, name)}")
    if not (o.lr > 0 and _finite(o.lr)) or not 0 <= o.min_lr_ratio <= 1:
        bad(f"optim.lr must be a finite number > 0 and optim.min_lr_ratio in [0, 1] (got {o.lr}, {o.min_lr_ratio})")
    if not (o.grad_clip > 0 and _finite(o.grad_clip)):
        bad(f"optim.grad_clip must be a finite number > 0, got {o.grad_clip}")
    if not (o.weight_decay >= 0 and _finite(o.weight_decay)):
        bad(f"optim.weight_decay must be a finite number >= 0, got {o.weight_decay}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        bad(f"optim.betas must be two numbers in [0, 1), got {list(o.betas)}")
    for name in ("warmup_steps", "threads"):
        if getattr(o, name) < 0:
            bad(f"optim.{name} must be >= 0, got {getattr(o, name)}")
    if any(k < 1 for k in o.keep_checkpoints):
        bad(f"optim.keep_checkpoints steps must be >= 1, got {list(o.keep_checkpoints)}")
    if len(o.loss_weights) != 3 or any(not (w >= 0 and w < float("inf")) for w in o.loss_weights):
        bad(f"optim.loss_weights must be three finite weights >= 0 (CE, L1, BCE), got {list(o.loss_weights)}")
    if max(o.loss_weights, default=0) < 1e-6:
        bad("optim.loss_weights are all (nearly) zero: nothing would be trained", "the paper's are [0.1, 0.9, 1.0]")
    if o.precision not in ("auto", "fp32", "bf16"):
        bad(f"optim.precision {o.precision!r}", "use auto, fp32 or bf16")
    if o.ce_label not in ("data", "target"):
        bad(f"optim.ce_label {o.ce_label!r}", "use data (the next token) or target (the target's argmax)")


def _check_data_and_eval(r: Any, bad: Refuse) -> None:
    """[data], [eval] and the target's dtype."""
    da = r.data
    for name, low in (("num_prompts", 2), ("max_new_tokens", 1), ("batch_size", 1)):
        if getattr(da, name) < low:
            bad(f"data.{name} must be >= {low}, got {getattr(da, name)}")
    for key, t in (("data.temperature", da.temperature), ("eval.temperature", r.eval.temperature)):
        if t < 0:
            bad(f"{key} must be >= 0, got {t}")
    if not 1 <= r.eval.holdout < da.num_prompts:
        bad(f"eval.holdout must be in [1, data.num_prompts), got {r.eval.holdout}")
    if r.eval.every < 0:
        bad(f"eval.every must be >= 0 (0 = only at the end), got {r.eval.every}")
    if da.source not in ("regenerate", "responses"):
        bad(f"data.source {da.source!r}", "use regenerate or responses")
    if da.extra_responses < 0 or (da.extra_responses and da.source != "regenerate"):
        bad("data.extra_responses must be >= 0, and is for source = \"regenerate\" (it adds the dataset's answers)")
    if da.extra_dataset is not None and not da.extra_dataset.strip():
        bad("data.extra_dataset is empty", "name a dataset: sharegpt, or a local JSON/JSONL file with data.response_field")
    if da.extra_dataset is not None and not da.extra_responses:
        bad("data.extra_dataset names where data.extra_responses come from; it needs data.extra_responses > 0")
    if da.prompt_filter and da.prompt_filter not in PROMPT_FILTERS:
        bad(f"data.prompt_filter {da.prompt_filter!r}", f"use one of: {', '.join(PROMPT_FILTERS)} (or leave it out for every prompt)")
    if not 1 <= da.topk <= 1024:
        bad(f"data.topk must be in [1, 1024], got {da.topk}")
    if da.precision not in ("fp32", "bf16"):
        bad(f"data.precision {da.precision!r}", "use fp32 or bf16")
    if r.target.dtype not in ("fp32", "bf16", "fp16"):
        bad(f"target.dtype {r.target.dtype!r}", "use fp32, bf16 or fp16")


def _check_init_from(init_from: str, bad: Refuse) -> None:
    """`optim.init_from` is a draft folder whose config reads: checked now, not after the data is built."""
    p = Path(init_from).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file():
        bad(f"optim.init_from {init_from!r} is not a draft folder (no config.json there; relative paths are "
            "read from the current folder)", "give the folder a previous `dsparkctl train --out` wrote")
    try:
        read_draft_config(p, f"optim.init_from {init_from}")
    except CheckpointError as exc:
        raise InputError(exc.message, "give optim.init_from a draft folder `dsparkctl train --out` wrote") from None
