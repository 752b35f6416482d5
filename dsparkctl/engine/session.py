"""Assemble target + draft for a run from user-facing specs: the one way commands open models."""

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
    device: torch.device
    dtype: torch.dtype
    stop_ids: list[int]
    embedded_target: bool = False
    draft: DSparkDraft | None = None
    draft_name: str = ""
    adapter: TargetAdapter | None = None  # taps the draft's layers
    notes: list[str] = field(default_factory=list)  # things the user must be told (e.g. untrained draft)

    def plain_adapter(self) -> TargetAdapter:
        """An adapter on the same model without feature taps (for the baseline)."""
        return TargetAdapter(self.target.model, ())

    def load_draft(self, spec: str | None, revision: str | None = None, seed: int = 0,
                   random_draft_kw: dict[str, Any] | None = None) -> tuple[DSparkDraft, str, list[str]]:
        """(draft, display name, notes) for a draft spec, checked against this session's target:
        the shipped default (embedded target), 'random', a folder or a hub id."""
        probe = TargetAdapter(self.target.model, ())
        if spec in (None, "", "default"):
            shipped = default_draft_dir() if self.embedded_target else None
            if shipped is not None:
                return load_draft(shipped, probe), f"shipped:{shipped.name}", []
            return (random_draft(probe, seed=seed, **(random_draft_kw or {})), "random-init",
                    ["the draft is freshly initialised (untrained): acceptance will be near zero; "
                     "pass --draft with a trained DeepSpec draft"])
        if spec == "random":
            return (random_draft(probe, seed=seed, **(random_draft_kw or {})), "random-init",
                    ["the draft is freshly initialised (untrained) as asked"])
        return load_draft(spec, probe, revision=revision), str(spec), []


def open_target(target: str | None, device: str = "auto", dtype: str = "auto", revision: str | None = None,
                trust_remote_code: bool = False, log: Callable[[str], None] = print,
                parallel: str = "none") -> Session:
    """A session holding the target only (embedded default, a folder or a hub id); `parallel`
    spreads a big target (models/loading.py: device-map or tp)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tgt = load_target(target, dev, dt, revision=revision, trust_remote_code=trust_remote_code, log=log,
                      parallel=parallel)
    return Session(target=tgt, device=dev, dtype=dt, stop_ids=stop_token_ids(tgt.tokenizer, tgt.model),
                   embedded_target=target in (None, "", "embedded"))


def open_session(target: str | None, draft: str | None, device: str = "auto", dtype: str = "auto",
                 revision: str | None = None, trust_remote_code: bool = False, seed: int = 0,
                 log: Callable[[str], None] = print, random_draft_kw: dict[str, Any] | None = None,
                 parallel: str = "none") -> Session:
    """The target and one draft; the session's adapter taps the draft's layers."""
    sess = open_target(target, device, dtype, revision, trust_remote_code, log, parallel)
    sess.draft, sess.draft_name, notes = sess.load_draft(draft, revision, seed, random_draft_kw)
    sess.notes.extend(notes)
    sess.adapter = TargetAdapter(sess.target.model, sess.draft.cfg.target_layer_ids)
    return sess
