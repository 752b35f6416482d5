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
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from dsparkctl.errors import InputError, option
from dsparkctl.train.recipe_checks import validate

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
    extra_dataset: str | None = None  # where those answers come from (sharegpt or a local file); None: data.dataset
    prompt_filter: str = ""  # "" = every prompt; "prose" = only requests for prose (no code, Latin script)
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
    ce_label: str = "data"  # the CE term's x*: "data" = the sequence's next token, "target" = the target's argmax
    init_from: str = ""  # a draft folder to start from (same shape, or fewer layers); the optimizer starts fresh
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

    def _hashed(self) -> dict[str, Any]:
        """to_dict() without the keys added after caches and runs existed, while they hold their
        defaults: older recipes keep the keys their data and run folders were filed under."""
        d = self.to_dict()
        if not d["data"]["prompt_filter"]:
            del d["data"]["prompt_filter"]
        if d["optim"]["ce_label"] == "data":
            del d["optim"]["ce_label"]
        return d

    def digest(self, *sections: str) -> str:
        """Short hash of the named sections (all when none): keys caches and run folders."""
        d = self._hashed()
        part = {s: d[s] for s in sections} if sections else d
        return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:12]

    def data_digest(self) -> str:
        """What the cached data depends on: target and data settings, except how many prompts
        are used (parts are prefix-stable, so a larger num_prompts extends the same cache)."""
        d = self._hashed()
        part = {"target": d["target"], "data": {k: v for k, v in d["data"].items()
                                                if k not in ("num_prompts", "extra_responses", "extra_dataset")}}
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
