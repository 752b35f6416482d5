"""Training recipes: TOML files loaded through one validating loader into frozen dataclasses.

A recipe has five sections (every key optional; defaults below). Unknown sections or keys are
rejected, and `--set key=value` overrides go through the same loader (`section.key=value`, or a
bare `key=value` when the key name is unique across sections).

    [target]    which target model (default: the embedded SmolLM2-135M-Instruct)
    [draft]     the draft shape: layers, tapped target layers, γ, Markov rank/type, confidence
    [data]      prompt source and response regeneration by the target (self-distillation)
    [optim]     AdamW, LR schedule, batch of sequences x anchors, steps, checkpoints
    [eval]      held-out split for the teacher-forced τ printed at the end
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Sequence

from dsparkctl.errors import CheckpointError, InputError, option
from dsparkctl.models.draft_io import read_draft_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class TargetSection:
    model: str = "embedded"  # "embedded", a local transformers folder or a hub id
    dtype: str = "fp32"  # dtype the target runs in while regenerating and extracting features


@dataclass(frozen=True)
class DraftSection:
    num_layers: int = 2  # draft transformer layers
    layer_ids: tuple[int, ...] = (1, 15, 27)  # tapped target layers (output of layer i)
    block_size: int = 5  # γ
    markov_rank: int = 64  # r; 0 = DFlash-style draft (no Markov head)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence: bool = True  # confidence head on/off
    mask_token_id: int | None = None  # None: the target's pad token, else a reserved special token
    intermediate_size: int | None = None  # None: the target's MLP width
    vocab_size: int = 0  # K > 0: the draft's head covers the K most frequent response tokens; 0 = full
    init: str = "random"  # random: N(0, 0.02); target: layers copied from the target's top layers
    tap_norm: bool = False  # scale each tapped layer to unit RMS before fc (folded into fc on export)


@dataclass(frozen=True)
class DataSection:
    dataset: str = "sharegpt"  # built-in name, local file or hub id (see data/prompts.py)
    field: str | None = None  # prompt field for local files / hub datasets
    source: str = "regenerate"  # regenerate: the target answers; responses: the dataset's own answers
    response_field: str | None = None  # answer field for source = "responses" with local files
    num_prompts: int = 600  # prompts used (after the length filter), held-out first, then training
    max_prompt_tokens: int = 256  # prompts longer than this (chat-encoded) are skipped
    max_new_tokens: int = 256  # response length cap (regenerated, or dataset answers cut to it)
    temperature: float = 0.0  # regeneration temperature (0 = greedy)
    batch_size: int = 32  # prompts per cached part (one regeneration batch)
    topk: int = 32  # target distribution cached as its top-k per position
    extra_responses: int = 0  # also train on this many of the dataset's own answers, teacher-forced (cheap data)
    seed: int = 0
    precision: str = "fp32"  # teacher-forced passes: fp32 (the target as loaded) or bf16 autocast (~2x faster with AMX); regeneration is always as loaded


@dataclass(frozen=True)
class OptimSection:
    steps: int = 2000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    batch_sequences: int = 4  # sequences per step
    anchors_per_sequence: int = 16  # blocks per sequence per step (one forward)
    checkpoint_every: int = 100  # steps between resumable checkpoints
    keep_checkpoints: tuple[int, ...] = ()  # steps whose checkpoint is kept (e.g. for equal-budget comparisons)
    threads: int = 0  # torch CPU threads (0 = leave torch's default)
    seed: int = 0
    loss_weights: tuple[float, ...] = (0.1, 0.9, 1.0)  # CE, L1, BCE (the paper's)
    init_from: str = ""  # a draft folder to start from (same shape); the optimizer starts fresh
    precision: str = "auto"  # the draft's forward: bf16 autocast or fp32; auto = bf16 on a GPU, fp32 on a CPU


@dataclass(frozen=True)
class EvalSection:
    holdout: int = 24  # the first N sequences are kept out of training for the teacher-forced τ
    temperature: float = 0.0  # temperature at which the held-out τ is computed
    every: int = 0  # also evaluate at every checkpoint whose step is a multiple of this (0 = only at the end)


@dataclass(frozen=True)
class Recipe:
    name: str = "draft"
    target: TargetSection = TargetSection()
    draft: DraftSection = DraftSection()
    data: DataSection = DataSection()
    optim: OptimSection = OptimSection()
    eval: EvalSection = EvalSection()

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def digest(self, *sections: str) -> str:
        """Short hash of the named sections (all when none): keys caches and run folders."""
        d = self.to_dict()
        part = {s: d[s] for s in sections} if sections else d
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:12]

    def data_digest(self) -> str:
        """What the cached data depends on: target and data settings, except how many prompts
        are used (parts are prefix-stable, so a larger num_prompts extends the same cache)."""
        d = self.to_dict()
        part = {"target": d["target"], "data": {k: v for k, v in d["data"].items()
                                                if k not in ("num_prompts", "extra_responses")}}
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:12]


SECTIONS: dict[str, type] = {"target": TargetSection, "draft": DraftSection, "data": DataSection,
                             "optim": OptimSection, "eval": EvalSection}


def _type_default(cls: type, f: dataclasses.Field) -> Any:
    """A value of the type a recipe key takes: its default, or for an optional key (default None:
    mask_token_id, data.field, ...) an empty value of the type it is annotated with (`int | None`: 0)."""
    if f.default is not None:
        return f.default
    kinds = typing.get_args(typing.get_type_hints(cls)[f.name])
    return next(k() for k in (str, float, int) if k in kinds)


def _coerce(value: Any, default: Any, where: str) -> Any:
    """Check/convert a TOML value against the field's default type."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif isinstance(default, str):
        if isinstance(value, str):
            return value
    elif isinstance(default, tuple):
        if isinstance(value, (list, tuple)):
            kind = type(default[0]) if default else int
            ok = all(not isinstance(v, bool) and (isinstance(v, int) if kind is int else
                                                  isinstance(v, (int, float)) and math.isfinite(v)) for v in value)
            if ok:  # no silent rounding of 0.9 to 0, no "1" read as 1
                return tuple(kind(v) for v in value)
    if isinstance(default, tuple):
        what = "tuple (a list of integers)" if default and isinstance(default[0], int) else "tuple (a list of finite numbers)"
    else:
        what = {bool: "bool (true or false)", int: "int (an integer)", float: "float (a finite number)",
                str: "str (a string)"}[type(default)]
    raise InputError(f"{where}: expected {what}, got {value!r}", "fix the value in the recipe")


def recipe_from_dict(raw: Mapping[str, Any], source: str = "recipe") -> Recipe:
    """Build and validate a Recipe; unknown sections/keys and wrong types raise InputError."""
    kw: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "name":
            if not isinstance(value, str) or not value:
                raise InputError(f"{source}: name must be a non-empty string", 'e.g. name = "my-draft"')
            kw["name"] = value
            continue
        if key not in SECTIONS:
            raise InputError(f"{source}: unknown recipe key {key!r}",
                             f"use name or the sections {', '.join(SECTIONS)}")
        if not isinstance(value, Mapping):
            raise InputError(f"{source}: [{key}] must be a table", f"write it as a [{key}] section")
        cls = SECTIONS[key]
        defaults = {f.name: _type_default(cls, f) for f in dataclasses.fields(cls)}
        fields = {}
        for k, v in value.items():
            if k not in defaults:
                raise InputError(f"{source}: unknown recipe key {key}.{k}",
                                 f"valid keys in [{key}]: {', '.join(defaults)}")
            fields[k] = _coerce(v, defaults[k], f"{source}: {key}.{k}")
        kw[key] = cls(**fields)
    recipe = Recipe(**kw)
    validate(recipe, source)
    return recipe


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


def validate(r: Recipe, source: str) -> None:
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


def _check_draft(d: DraftSection, bad: Refuse) -> None:
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


def _check_optim(o: OptimSection, bad: Refuse) -> None:
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


def _check_data_and_eval(r: Recipe, bad: Refuse) -> None:
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


def _toml(text: str, where: str) -> dict[str, Any]:
    """TOML text as a dict; what tomllib cannot read is one InputError, also nesting deeper than its
    parser recurses and an integer of more digits than Python converts (tomllib raises those raw)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{where}: not valid TOML ({' '.join(str(exc).split())[:200]})",
                         "fix the TOML syntax at that line") from None
    except RecursionError:
        raise InputError(f"{where}: not valid TOML (nested too deeply to read)",
                         "recipes hold flat tables of plain values") from None
    except ValueError as exc:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise InputError(f"{where}: not valid TOML ({str(exc).split(';')[0][:120]})",
                         "check the value: no recipe key takes a number of thousands of digits") from None


def parse_overrides(pairs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`section.key=value` / `key=value` strings -> nested dict (values parsed as TOML); the recipe's
    top-level `name=value` is under the section "" ."""
    unique: dict[str, str] = {"name": ""}
    clash: set[str] = set()
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name in unique:
                clash.add(f.name)
            unique[f.name] = sec
    out: dict[str, dict[str, Any]] = {}
    example = f"e.g. {option('overrides')} draft.markov_rank=0"
    for pair in pairs:
        if "=" not in pair:
            raise InputError(f"{option('overrides')} {pair!r}: expected key=value", example)
        key, text = (s.strip() for s in pair.split("=", 1))
        if "." in key:
            sec, name = key.split(".", 1)
        elif key in unique and key not in clash:
            sec, name = unique[key], key
        else:
            hint = "qualify it with its section, e.g. optim.seed" if key in clash else "see the recipe's keys"
            raise InputError(f"{option('overrides')} {key}: unknown recipe key" if key not in clash
                             else f"{option('overrides')} {key}: ambiguous key", hint)
        if not text:
            raise InputError(f"{option('overrides')} {key}= has an empty value",
                             f"give {key} a value, e.g. {option('overrides')} {key}=VALUE (a string may be quoted)")
        if "\n" in text or "\r" in text:
            raise InputError(f"{option('overrides')} {key}: the value holds a line break",
                             "give the value on one line")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # bare strings
        except (RecursionError, ValueError):
            raise InputError(f"{option('overrides')} {key}: the value is nested too deeply or has too many digits "
                             "to read", "give a plain value, e.g. a number, a string or a short list") from None
        out.setdefault(sec, {})[name] = value
    return out


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Read a TOML recipe (or defaults when path is None), apply --set overrides, validate."""
    raw: dict[str, Any] = {}
    source = "recipe"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            what = "does not exist" if not p.exists() else "is a folder" if p.is_dir() else "is not a regular file"
            raise InputError(f"recipe {p} {what}", "pass a TOML file such as recipes/smollm2-135m-dspark.toml")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{p}: not UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start})",
                             "save the recipe as UTF-8") from None
        raw = _toml(text, str(p))
        if "name" not in raw:
            raw["name"] = p.stem
    for sec, kv in parse_overrides(overrides).items():
        if sec == "":
            raw.update(kv)
            continue
        if sec not in SECTIONS:
            raise InputError(f"{option('overrides')} {sec}.…: unknown recipe section {sec!r}",
                             f"use {', '.join(SECTIONS)}")
        base = raw.setdefault(sec, {})
        if not isinstance(base, dict):
            raise InputError(f"{source}: [{sec}] must be a table", f"write it as a [{sec}] section")
        base.update(kv)
    return recipe_from_dict(raw, source)
