"""Assemble target + draft for a run from user-facing specs: the one way commands open models."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dsparkctl.errors import UsageError
from dsparkctl.models.cpu_kernels import (ALWAYS_STOCK, PackedLinear, cached_choice, choose_kernels, kernel_label,
                                         pack_linears, packing_supported, remember_choice, swap_modules,
                                         unpack_linears, use_stock_up_to)
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_io import load_draft, random_draft
from dsparkctl.models.loading import (RANDOM_DRAFT, LoadedTarget, default_draft_dir, is_default_draft, is_embedded,
                                      load_target, resolve_device, resolve_dtype, stop_token_ids)
from dsparkctl.models.target import TargetAdapter

CPU_KERNELS = ("auto", "packed", "stock")
CALIBRATION_NAME = "calibration.json"  # a draft folder's own calibration (generate and serve-config use it by default)


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
    stock_rows: int | None = ALWAYS_STOCK  # calls of ≤ this many rows take the stock kernel; None: auto pending

    @property
    def cpu_kernels(self) -> str:
        """How the linears run: stock, packed or stock<=N,packed (models/cpu_kernels.py); "auto"
        while the choice is pending (open_target(settle=False))."""
        return "auto" if self.stock_rows is None else kernel_label(self.stock_rows)

    def conditions(self) -> dict[str, Any]:
        """What a step's time depends on besides the models: the machine, torch's threads, the
        kernels, device and dtype (recorded in SPS tables; `sps_io.condition_notes` compares)."""
        import platform

        from dsparkctl.models.cpu_kernels import _cpu_info

        return {"cpu": _cpu_info()["name"], "machine": platform.machine(), "threads": torch.get_num_threads(),
                "cpu_kernels": self.cpu_kernels, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "torch": torch.__version__}

    def default_calibration(self) -> "Path | None":
        """`calibration.json` beside the session's draft (`dsparkctl calibrate` output shipped with it),
        when it was fitted for this very draft (its fingerprint); else None."""
        if self.draft is None or self.draft_dir is None:
            return None
        path = self.draft_dir / CALIBRATION_NAME
        if not path.is_file():
            return None
        from dsparkctl.calibrate import calibration_draft_notes
        from dsparkctl.errors import InputError

        try:
            if calibration_draft_notes(path, self.draft.fingerprint()):
                return None  # it does not say which draft it is for: not applied unasked
        except InputError:
            return None
        return path

    def plain_adapter(self) -> TargetAdapter:
        """An adapter on the same model without feature taps (for the baseline)."""
        return TargetAdapter(self.target.model, ())

    def load_draft(self, spec: str | None, revision: str | None = None, seed: int = 0,
                   random_draft_kw: dict[str, Any] | None = None) -> tuple[DSparkDraft, str, list[str]]:
        """(draft, display name, notes) for a draft spec, checked against this session's target:
        the shipped default (embedded target), 'random', a folder or a hub id."""
        draft, name, notes = self._load_draft(spec, revision, seed, random_draft_kw)
        if is_default_draft(spec) and self.embedded_target:
            self.draft_dir = default_draft_dir()
        elif not is_default_draft(spec) and spec != RANDOM_DRAFT and Path(str(spec)).expanduser().is_dir():
            self.draft_dir = Path(str(spec)).expanduser()
        if self.stock_rows is not None:  # else settle_kernels packs it once the choice is made
            self._pack_draft(draft)
        return draft, name, notes

    def _pack_draft(self, draft: DSparkDraft) -> None:
        if self.stock_rows < ALWAYS_STOCK and pack_linears(draft, keep_weight=True):  # small; reads `.weight.dtype`
            use_stock_up_to(draft, self.stock_rows)  # the target's routing by row count

    def settle_kernels(self, log: Callable[[str], None] = print, drafts: tuple[DSparkDraft, ...] = ()) -> None:
        """For `--cpu-kernels auto`: choose the route by row count (timed now when no choice is
        cached for this machine and model; under torchrun rank 0 times and the others follow),
        then pack the session's draft and `drafts` (loaded while the choice was pending) to match."""
        if self.stock_rows is not None:
            return
        from dsparkctl.distributed import all_gather, world

        before = dict(self.target.model.named_modules())  # what drafts loaded meanwhile may have borrowed
        rows = ALWAYS_STOCK
        if world().main:
            model = self.target.model
            cached = cached_choice(model) if world().distributed else None  # one process: read in open_target
            if cached is not None:
                rows = cached
            elif pack_linears(model, keep=self._kept(), routing=True):
                try:
                    rows, _ = choose_kernels(model, _row_forward(model), log=log)
                except Exception as e:  # a model whose forward needs more than input_ids: stay on stock kernels
                    log(f"note: could not time the CPU kernels on this target ({type(e).__name__}); using stock "
                        "kernels (pass --cpu-kernels packed to pack anyway)")
                    remember_choice(model, ALWAYS_STOCK, {"reason": f"forward failed: {type(e).__name__}"}, log)
        rows = all_gather(rows)[0]  # every rank routes as rank 0 chose (ranks never read the cache apart)
        self._route(rows)
        # a draft that borrowed a target layer (its LM head) while the choice was pending still holds
        # the layer routing replaced: point it at the replacement, so nothing is packed twice
        after = dict(self.target.model.named_modules())
        moved = {id(m): after[n] for n, m in before.items() if n in after and after[n] is not m}
        for d in {id(d): d for d in (self.draft, *drafts) if d is not None}.values():
            swap_modules(d, lambda child: moved.get(id(child)))
            self._pack_draft(d)

    def _kept(self) -> tuple[torch.nn.Module, ...]:
        head = self.target.model.get_output_embeddings()
        return (head,) if head is not None else ()

    def _route(self, rows: int) -> None:
        """Bring the target's linears to a choice, from stock or from packed-with-both-copies."""
        model = self.target.model
        if rows >= ALWAYS_STOCK:
            unpack_linears(model)
        elif not any(isinstance(m, PackedLinear) for m in model.modules()):
            if not pack_linears(model, keep=self._kept(), routing=rows > 0):
                rows = ALWAYS_STOCK  # this torch's kernel failed its self-check
        if rows < ALWAYS_STOCK:
            use_stock_up_to(model, rows, free=True)
        self.stock_rows = rows

    def _load_draft(self, spec, revision, seed, random_draft_kw):
        probe = TargetAdapter(self.target.model, ())
        if is_default_draft(spec):
            shipped = default_draft_dir() if self.embedded_target else None
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
                parallel: str = "none", cpu_kernels: str = "stock", settle: bool = True) -> Session:
    """A session holding the target only (embedded default, a folder or a hub id); `parallel`
    spreads a big target (models/loading.py: device-map or tp). `cpu_kernels="packed"` packs the
    linears of a CPU fp32 model for oneDNN (inference only: models/cpu_kernels.py); "auto" routes
    each call by its row count to the kernel this CPU runs faster (timed once per machine and
    model with both copies kept, then cached; a cached choice makes only the copies it reads);
    elsewhere, or where this torch lacks the kernels, it stays "stock" (see `Session.cpu_kernels`).
    `settle=False` leaves an auto choice pending (the caller checks its other inputs first, then
    calls `Session.settle_kernels`)."""
    if cpu_kernels not in CPU_KERNELS:
        raise UsageError(f"unknown --cpu-kernels {cpu_kernels!r}", f"use one of {', '.join(CPU_KERNELS)}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tgt = load_target(target, dev, dt, revision=revision, trust_remote_code=trust_remote_code, log=log,
                      parallel=parallel)
    sess = Session(target=tgt, device=dev, dtype=dt, stop_ids=stop_token_ids(tgt.tokenizer, tgt.model),
                   embedded_target=is_embedded(target))
    if cpu_kernels == "packed" and parallel == "none":
        sess._route(0)
    elif cpu_kernels == "auto" and parallel == "none" and packing_supported(tgt.model):
        from dsparkctl.distributed import world

        cached = None if world().distributed else cached_choice(tgt.model)  # ranks: rank 0 decides, in settle
        if cached is not None:
            sess._route(cached)  # only the copies this choice reads are ever made
        else:
            sess.stock_rows = None  # pending until settle_kernels
            if settle:
                sess.settle_kernels(log)
    return sess


def _row_forward(model: torch.nn.Module) -> Callable[[int], object]:
    """A forward of the model over `rows` tokens (no cache): what kernel timing runs."""
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    ids = (torch.arange(1, 9) % vocab)[None].to(next(model.parameters()).device)
    return lambda rows: model(input_ids=ids[:, :rows], use_cache=False)


def open_session(target: str | None, draft: str | None, device: str = "auto", dtype: str = "auto",
                 revision: str | None = None, trust_remote_code: bool = False, seed: int = 0,
                 log: Callable[[str], None] = print, random_draft_kw: dict[str, Any] | None = None,
                 parallel: str = "none", cpu_kernels: str = "stock", settle: bool = True) -> Session:
    """The target and one draft; the session's adapter taps the draft's layers. Kernel timing
    (`--cpu-kernels auto`, not yet cached) runs after the draft's checks, or, with `settle=False`,
    when the caller calls `Session.settle_kernels` after its own."""
    sess = open_target(target, device, dtype, revision, trust_remote_code, log, parallel, cpu_kernels, settle=False)
    sess.draft, sess.draft_name, notes = sess.load_draft(draft, revision, seed, random_draft_kw)
    sess.notes.extend(notes)
    if settle:
        sess.settle_kernels(log)
    sess.adapter = TargetAdapter(sess.target.model, sess.draft.cfg.target_layer_ids)
    return sess
