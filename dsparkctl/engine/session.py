"""Assemble target + draft for a run from user-facing specs: the one way commands open models."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.distributed import Split
from dsparkctl.engine.kernel_choice import cpu_info, resolve
from dsparkctl.errors import UsageError, option
from dsparkctl.formats.calibration import own_calibration
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_io import load_draft, random_draft
from dsparkctl.models.loading import (RANDOM_DRAFT, LoadedTarget, default_draft_dir, is_default_draft, is_embedded,
                                      load_target, resolve_device, resolve_dtype, stop_token_ids)
from dsparkctl.models.packed_linear import PACKED, STOCK, Route, apply_route, pack_like, packing_supported, swap_modules
from dsparkctl.models.quant_linear import DRAFT_WEIGHTS, Int8Linear, can_quantize, int8_supported, quantize_draft
from dsparkctl.models.target import TargetAdapter

CPU_KERNELS = ("auto", "packed", "stock")


def draft_folder_for(spec: str | None, embedded_target: bool) -> Path | None:
    """The local folder a draft spec reads from: the shipped draft's (with the embedded target), a
    folder given by path; None for 'random' and hub ids. Known before any model loads."""
    if is_default_draft(spec):
        return default_draft_dir() if embedded_target else None
    if spec != RANDOM_DRAFT and Path(str(spec)).expanduser().is_dir():
        return Path(str(spec)).expanduser()
    return None


@dataclass(frozen=True)
class ModelSettings:
    """Which target a command loads and how it runs: the fields every model-running command's
    spec shares (GenerateSpec, EvalSpec, ProfileSpec inherit them), passed to `open_target`."""
    target: str | None = None  # folder or hub id; None: the embedded model
    revision: str | None = None
    trust_remote_code: bool = False
    target_parallel: str = "none"  # models/loading.py TARGET_PARALLEL
    device: str = "auto"
    dtype: str = "auto"
    cpu_kernels: str = "auto"  # CPU_KERNELS
    draft_weights: str = "auto"  # models/quant_linear.py DRAFT_WEIGHTS
    seed: int = 0


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
    draft_dir: "Path | None" = None  # the local folder the draft was read from (None: random or unknown)
    route: Route | None = STOCK  # how target and draft linears run (models/packed_linear.py); None: auto pending
    draft_weights: str = "fp32"  # the setting asked for (DRAFT_WEIGHTS); `draft_precision` says what the draft runs

    @property
    def draft_precision(self) -> str | None:
        """What the session's draft's linears run in: int8, or its own dtype (fp32, bfloat16, ...);
        None without a draft."""
        if self.draft is None:
            return None
        if any(isinstance(m, Int8Linear) for m in self.draft.modules()):
            return "int8"
        dtype = next(self.draft.parameters()).dtype
        return "fp32" if dtype == torch.float32 else str(dtype).replace("torch.", "")

    @property
    def split(self) -> Split:
        """How this session's runs share their work among torchrun ranks: divided, or all together
        when the ranks hold shards of one target (tensor parallel)."""
        return Split(replicated=self.target.tensor_parallel)

    @property
    def cpu_kernels(self) -> str:
        """How the linears run: stock, packed or stock<=N,packed; "auto" while the choice is
        pending (open_target(settle=False))."""
        return "auto" if self.route is None else self.route.label

    def conditions(self) -> dict[str, Any]:
        """What a step's time depends on besides the models: the machine, torch's threads, the
        kernels, device and dtype (recorded in SPS tables; `formats.sps.condition_notes` compares)."""
        import platform

        return {"cpu": cpu_info()["name"], "machine": platform.machine(), "threads": torch.get_num_threads(),
                "cpu_kernels": self.cpu_kernels, "draft_weights": self.draft_precision, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "torch": torch.__version__}

    def default_calibration(self) -> "Path | None":
        """`calibration.json` beside the session's draft (`dsparkctl calibrate` output shipped with it),
        when it was fitted for this very draft (its fingerprint); else None."""
        if self.draft is None:
            return None

        return own_calibration(self.draft_dir, self.draft.fingerprint())

    def plain_adapter(self) -> TargetAdapter:
        """An adapter on the same model without feature taps (for the baseline)."""
        return TargetAdapter(self.target.model, ())

    def draft_folder(self, spec: str | None) -> Path | None:
        """The local folder a draft spec reads from in this session (`draft_folder_for`)."""
        return draft_folder_for(spec, self.embedded_target)

    def load_draft(self, spec: str | None, revision: str | None = None, seed: int = 0,
                   random_draft_kw: dict[str, Any] | None = None) -> tuple[DSparkDraft, str, list[str]]:
        """(draft, display name, notes) for a draft spec, checked against this session's target:
        the shipped default (embedded target), 'random', a folder or a hub id."""
        draft, name, notes = self._load_draft(spec, revision, seed, random_draft_kw)
        if self._quantizes(draft):
            quantize_draft(draft)
        if self.route is not None:  # else settle_kernels packs it once the choice is made (int8 parts stay)
            pack_like(draft, self.route)
        return draft, name, notes

    def _quantizes(self, draft: DSparkDraft) -> bool:
        """Whether `draft_weights` puts this draft in int8: where asked (refused where it cannot run)
        or, for auto, wherever it can (CPU, fp32, torch's int8 ops present and self-checked)."""
        if self.draft_weights == "fp32" or (self.draft_weights == "auto" and not can_quantize(draft)):
            return False
        if not can_quantize(draft):
            p = next(draft.parameters())
            raise UsageError(f"{option('draft_weights')} int8 needs a draft on the CPU in fp32 and torch's int8 "
                             f"linear ops (this draft: {p.device.type}, {str(p.dtype).replace('torch.', '')})",
                             f"use {option('draft_weights')} fp32 or auto")
        return True

    def settle_kernels(self, log: Callable[[str], None] = print, drafts: tuple[DSparkDraft, ...] = ()) -> None:
        """For `--cpu-kernels auto`: resolve the route (engine/kernel_choice.py: cached, or timed
        now), then pack the session's draft and `drafts` (loaded while the choice was pending) to match."""
        if self.route is not None:
            return

        model = self.target.model
        before = dict(model.named_modules())  # what drafts loaded meanwhile may have borrowed
        self.route = apply_route(model, resolve(model, self._kept(), log), self._kept())
        # a draft that borrowed a target layer (its LM head) while the choice was pending still holds
        # the layer routing replaced: point it at the replacement, so nothing is packed twice
        after = dict(model.named_modules())
        moved = {id(m): after[n] for n, m in before.items() if n in after and after[n] is not m}
        for d in {id(d): d for d in (self.draft, *drafts) if d is not None}.values():
            swap_modules(d, lambda child: moved.get(id(child)))
            pack_like(d, self.route)

    def _kept(self) -> tuple[torch.nn.Module, ...]:
        head = self.target.model.get_output_embeddings()
        return (head,) if head is not None else ()

    def _load_draft(self, spec, revision, seed, random_draft_kw):
        probe = TargetAdapter(self.target.model, ())
        if is_default_draft(spec):
            shipped = self.draft_folder(spec)
            if shipped is not None:
                return load_draft(shipped, probe), f"shipped:{shipped.name}", []
            return (random_draft(probe, seed=seed, **(random_draft_kw or {})), "random-init",
                    ["the draft is freshly initialised (untrained): acceptance will be near zero; "
                     "pass --draft with a trained DeepSpec draft"])
        if spec == RANDOM_DRAFT:
            return (random_draft(probe, seed=seed, **(random_draft_kw or {})), "random-init",
                    ["the draft is freshly initialised (untrained) as asked"])
        return load_draft(spec, probe, revision=revision), str(spec), []


def open_target(target: str | None, device: str = "auto", dtype: str = "auto", revision: str | None = None,
                trust_remote_code: bool = False, log: Callable[[str], None] = print,
                parallel: str = "none", cpu_kernels: str = "stock", settle: bool = True,
                draft_weights: str = "fp32") -> Session:
    """A session holding the target only (embedded default, a folder or a hub id); `parallel`
    spreads a big target (models/loading.py: device-map or tp). `cpu_kernels="packed"` packs the
    linears of a CPU fp32 model for oneDNN (inference only: models/packed_linear.py); "auto" routes
    each call by its row count to the kernel this CPU runs faster (engine/kernel_choice.py: timed
    once per machine and model, then cached; a cached choice makes only the copies it reads);
    elsewhere, or where this torch lacks the kernels, it stays "stock" (see `Session.cpu_kernels`).
    `settle=False` leaves an auto choice pending (the caller checks its other inputs first, then
    calls `Session.settle_kernels`)."""
    if cpu_kernels not in CPU_KERNELS:
        raise UsageError(f"unknown {option('cpu_kernels')} {cpu_kernels!r}", f"use one of {', '.join(CPU_KERNELS)}")
    if draft_weights not in DRAFT_WEIGHTS:
        raise UsageError(f"unknown {option('draft_weights')} {draft_weights!r}", f"use one of {', '.join(DRAFT_WEIGHTS)}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if draft_weights == "int8" and not (dev.type == "cpu" and dt == torch.float32 and int8_supported()):
        raise UsageError(f"{option('draft_weights')} int8 needs the CPU, fp32 and torch's int8 linear ops (this run: "
                         f"{dev.type}, {str(dt).replace('torch.', '')}"
                         f"{'' if int8_supported() or dev.type != 'cpu' else ', no working int8 ops'})",
                         f"use {option('draft_weights')} fp32 or auto")
    packs = f"{option('cpu_kernels')} packed runs oneDNN's kernels on one process's fp32 CPU model"
    if cpu_kernels == "packed" and (dev.type != "cpu" or dt != torch.float32 or parallel != "none"):
        raise UsageError(f"{packs} (this run: {dev.type}, {str(dt).replace('torch.', '')}"
                         f"{', ' + option('target_parallel') + ' ' + parallel if parallel != 'none' else ''})",
                         f"use {option('cpu_kernels')} auto or stock, or {option('dtype')} fp32 on the CPU")
    tgt = load_target(target, dev, dt, revision=revision, trust_remote_code=trust_remote_code, log=log,
                      parallel=parallel)
    if cpu_kernels == "packed" and not packing_supported(tgt.model):
        raise UsageError(f"{packs}: this torch lacks them, or the target's linears are not plain fp32 ones",
                         f"use {option('cpu_kernels')} auto or stock")
    sess = Session(target=tgt, device=dev, dtype=dt, stop_ids=stop_token_ids(tgt.tokenizer, tgt.model),
                   embedded_target=is_embedded(target), draft_weights=draft_weights)
    if cpu_kernels == "packed" and parallel == "none":
        sess.route = apply_route(tgt.model, PACKED, sess._kept())
    elif cpu_kernels == "auto" and parallel == "none" and packing_supported(tgt.model):
        sess.route = None  # pending until settle_kernels
        if settle:
            sess.settle_kernels(log)
    return sess


def open_session(target: str | None, draft: str | None, device: str = "auto", dtype: str = "auto",
                 revision: str | None = None, trust_remote_code: bool = False, seed: int = 0,
                 log: Callable[[str], None] = print, random_draft_kw: dict[str, Any] | None = None,
                 parallel: str = "none", cpu_kernels: str = "stock", settle: bool = True,
                 draft_weights: str = "fp32") -> Session:
    """The target and one draft; the session's adapter taps the draft's layers. Kernel timing
    (`--cpu-kernels auto`, not yet cached) runs after the draft's checks, or, with `settle=False`,
    when the caller calls `Session.settle_kernels` after its own."""
    sess = open_target(target, device, dtype, revision, trust_remote_code, log, parallel, cpu_kernels, settle=False,
                       draft_weights=draft_weights)
    sess.draft, sess.draft_name, notes = sess.load_draft(draft, revision, seed, random_draft_kw)
    sess.draft_dir = sess.draft_folder(draft)
    sess.notes.extend(notes)
    if settle:
        sess.settle_kernels(log)
    sess.adapter = TargetAdapter(sess.target.model, sess.draft.cfg.target_layer_ids)
    return sess
