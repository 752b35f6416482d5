"""Assemble target + draft for a run from user-facing specs (the CLI's and benchmarks' entry)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_io import load_draft, random_draft
from dsparkctl.models.loading import (LoadedTarget, default_draft_dir, load_target, resolve_device,
                                      resolve_dtype, stop_token_ids)
from dsparkctl.models.target import TargetAdapter


@dataclass
class Session:
    target: LoadedTarget
    adapter: TargetAdapter  # taps the draft's layers
    draft: DSparkDraft
    draft_name: str
    device: torch.device
    dtype: torch.dtype
    stop_ids: list[int]
    notes: list[str] = field(default_factory=list)  # things the user must be told (e.g. untrained draft)

    def plain_adapter(self) -> TargetAdapter:
        """An adapter on the same model without feature taps (for the baseline)."""
        return TargetAdapter(self.target.model, ())


def open_session(target: str | None, draft: str | None, device: str = "auto", dtype: str = "auto",
                 revision: str | None = None, trust_remote_code: bool = False, seed: int = 0,
                 log: Callable[[str], None] = print, random_draft_kw: dict[str, Any] | None = None) -> Session:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tgt = load_target(target, dev, dt, revision=revision, trust_remote_code=trust_remote_code, log=log)
    notes: list[str] = []
    probe = TargetAdapter(tgt.model, ())
    if draft in (None, "", "default"):
        shipped = default_draft_dir() if target in (None, "", "embedded") else None
        if shipped is not None:
            d = load_draft(shipped, probe)
            name = f"shipped:{shipped.name}"
        else:
            d = random_draft(probe, seed=seed, **(random_draft_kw or {}))
            name = "random-init"
            notes.append("the draft is freshly initialised (untrained): acceptance will be near zero; "
                         "pass --draft with a trained DeepSpec draft")
    elif draft == "random":
        d = random_draft(probe, seed=seed, **(random_draft_kw or {}))
        name = "random-init"
        notes.append("the draft is freshly initialised (untrained) as asked")
    else:
        d = load_draft(draft, probe, revision=revision)
        name = str(draft)
    adapter = TargetAdapter(tgt.model, d.cfg.target_layer_ids)
    return Session(target=tgt, adapter=adapter, draft=d, draft_name=name, device=dev, dtype=dt,
                   stop_ids=stop_token_ids(tgt.tokenizer, tgt.model), notes=notes)
