"""Resolve `--target` / `--draft` / `--device` / `--dtype` into loaded models.

`--target` defaults to the embedded SmolLM2-135M-Instruct; `--draft` defaults to the draft
shipped in the package for it (dsparkctl/assets/drafts/...), or, while none is shipped, to a
freshly initialised draft — which the CLI announces plainly.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.distributed import rank_device, world
from dsparkctl.errors import InputError, UsageError, option
from dsparkctl.models.draft_io import check_readable, resolve_folder
from dsparkctl.models.embedded import EMBEDDED_NAME, embedded_target_dir, quiet_transformers

EMBEDDED = "embedded"  # --target: the embedded SmolLM2 (as is an unset or empty --target)
DEFAULT_DRAFT = "default"  # --draft: the draft shipped for the embedded target (as is an unset or empty --draft)
RANDOM_DRAFT = "random"  # --draft: a freshly initialised, untrained draft
DEFAULT_DRAFT_NAME = "smollm2-135m-dspark"


def is_embedded(target: str | Path | None) -> bool:
    """Whether a --target spec stands for the embedded target."""
    return target in (None, "", EMBEDDED)


def is_default_draft(draft: str | Path | None) -> bool:
    """Whether a --draft spec stands for the shipped draft."""
    return draft in (None, "", DEFAULT_DRAFT)


def names_a_place(spec: str | Path | None) -> bool:
    """Whether a --target/--draft spec names a folder or hub id rather than one of the words above."""
    return spec is not None and str(spec) not in ("", EMBEDDED, DEFAULT_DRAFT, RANDOM_DRAFT)


def resolve_device(device: str) -> torch.device:
    """auto: CUDA when present; under torchrun `auto`/`cuda` mean this rank's GPU (LOCAL_RANK)."""

    if device == "auto":
        return torch.device(rank_device("auto") if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{option('device')} cuda was asked for but torch sees no CUDA device",
                         f"use {option('device')} cpu, or install a CUDA build of torch")
    return torch.device(rank_device(device))


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = ("auto", *_TORCH_DTYPES)  # --dtype


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _TORCH_DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", "use auto, fp32, bf16 or fp16")
    return _TORCH_DTYPES[dtype]


@dataclass
class LoadedTarget:
    model: Any
    tokenizer: Any
    name: str
    path: Path
    tensor_parallel: bool = False  # every torchrun rank holds a shard of this one model (`parallel="tp"`)


TARGET_PARALLEL = ("none", "device-map", "tp")


def load_target(spec: str | None, device: torch.device, dtype: torch.dtype, revision: str | None = None,
                trust_remote_code: bool = False, log: Callable[[str], None] = print,
                parallel: str = "none") -> LoadedTarget:
    """Load a transformers causal LM + tokenizer from the embedded default, a folder or a hub id.

    parallel: how a target that does not fit one device is spread, both transformers' own ways:
      none        the whole model on `device`
      device-map  one process, layers spread over the visible devices (`device_map="auto"`)
      tp          under torchrun, every rank holds a shard (`tp_plan="auto"`); the ranks then
                  work on the same prompts together (the session's `split`)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    if is_embedded(spec):
        folder, name = embedded_target_dir(log=log), EMBEDDED_NAME
    else:
        folder, name = resolve_folder(spec, revision), str(spec)
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} has no config.json", "pass a transformers model folder or hub id")
    check_readable(folder)
    if parallel not in TARGET_PARALLEL:
        raise UsageError(f"unknown {option('target_parallel')} {parallel!r}", f"use one of {', '.join(TARGET_PARALLEL)}")
    kw: dict = {}
    if parallel == "device-map":
        kw["device_map"] = "auto"
    elif parallel == "tp":
        if not world().distributed:
            raise UsageError(f"{option('target_parallel')} tp shards the target across torchrun ranks",
                             "launch with `torchrun --nproc-per-node N`, or use device-map in one process")
        kw["tp_plan"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code, **kw)
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"cannot load target {name}: {str(exc).splitlines()[0]}",
                         "pass a folder with config.json, safetensors weights and a tokenizer") from None
    if parallel == "none":
        model = model.to(device)
    return LoadedTarget(model=model.eval(), tokenizer=tok, name=name, path=folder, tensor_parallel=parallel == "tp")


def default_draft_dir() -> Path | None:
    """The draft shipped in the package for the embedded target, if present."""
    try:
        root = importlib.resources.files("dsparkctl") / "assets" / "drafts" / DEFAULT_DRAFT_NAME
    except ModuleNotFoundError:
        return None
    p = Path(str(root))
    return p if (p / "config.json").is_file() else None


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return sorted(ids)
