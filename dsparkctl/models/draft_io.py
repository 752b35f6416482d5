"""Load and save drafts in DeepSpec's released format (config.json + model.safetensors [+ index]).

Safe by construction: safetensors only (never pickle), index entries may not leave the folder,
every tensor name and shape is checked against the module, and the draft must agree with the
target on vocabulary, width and tapped layers.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from dsparkctl.checkpoint.hub import TOKENIZER_FILES, check_repo_id, endpoint, hub_errors, hub_reachable
from dsparkctl.checkpoint.source import INDEX, SINGLE, parse_index
from dsparkctl.models import draft_formats
from dsparkctl.errors import CheckpointError, InputError, ModelMismatchError, option
from dsparkctl.files.atomic import atomic_dir, cannot_create
from dsparkctl.files.ownership import replace_refusal
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_config import DraftConfig
from dsparkctl.strict_json import finite
from dsparkctl.strict_json import loads as strict_loads

BORROWED = ("embed_tokens.weight", "lm_head.weight")


def check_local_source(source: str) -> None:
    """A --target/--draft that can only be a local path (it starts with . / ~, or is no org/name
    id) must be a folder: said in a second, before anything loads."""
    p = Path(source).expanduser()
    if p.is_dir():
        return
    if p.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise InputError(f"model path {source} does not exist", "pass a local folder or a hub repo id like org/name")


def resolve_folder(source: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub repo id, fetched file by file into the hub cache:
    config.json, the safetensors index and its shards (or model.safetensors), and the tokenizer
    files that exist. Only safetensors weights are ever fetched."""
    p = Path(source).expanduser()
    if p.is_dir():
        return p
    s = str(source)
    check_local_source(s)
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    check_repo_id(s)  # an invalid id is invalid, not "missing from the cache"
    online = hub_reachable()  # offline: the cache at once, not retries with backoff

    def fetch(name: str, optional: bool = False) -> Path | None:
        try:
            return Path(huggingface_hub.hf_hub_download(s, name, revision=revision, endpoint=endpoint(),
                                                        local_files_only=not online))
        except LocalEntryNotFoundError:  # no network (or offline) and not cached: not "the repo has no ..."
            if optional:
                return None
            raise InputError(f"{s}: no such local folder, the hub cannot be reached and {name} is not in the "
                             "local hub cache", "check the folder's path, or connect (or set HF_ENDPOINT) and run "
                             "again") from None
        except EntryNotFoundError:
            if optional:
                return None
            raise InputError(f"{s}: the repo has no {name}", "is it a transformers model or DeepSpec draft?") from None

    with hub_errors(s):
        config = fetch("config.json")
        index = fetch(INDEX, optional=True)
        if index is not None:
            for shard in sorted(set(parse_index(index.read_bytes(), f"{s}: {INDEX}").values())):
                fetch(shard)
        else:
            fetch(SINGLE)
        for name in TOKENIZER_FILES:
            fetch(name, optional=True)
    return config.parent


def check_readable(folder: Path) -> None:
    """Refuse a model folder holding a file we may not read (config, weights, tokenizer): it is there,
    so it is not "missing", and no download fixes it; its permissions do."""
    with contextlib.suppress(OSError):
        for f in sorted(folder.iterdir()):
            if f.is_file() and not os.access(f, os.R_OK):
                raise InputError(f"{f} is not readable (permission denied)",
                                 f"make it readable (chmod u+r {f}) or run as its owner")


def check_compatible(cfg: DraftConfig, target: Any, source: str) -> None:
    """Refuse a draft that does not fit the target (vocab, width, tapped layers)."""
    if cfg.vocab_size != target.vocab_size:
        raise ModelMismatchError(
            f"{source}: draft vocabulary {cfg.vocab_size} != target vocabulary {target.vocab_size}",
            "use a draft trained for this target (same tokenizer)")
    if cfg.hidden_size != target.hidden_size:
        raise ModelMismatchError(
            f"{source}: draft hidden size {cfg.hidden_size} != target hidden size {target.hidden_size}",
            "use a draft trained for this target")
    if cfg.num_target_layers and cfg.num_target_layers != target.num_layers:
        raise ModelMismatchError(
            f"{source}: draft was trained for a {cfg.num_target_layers}-layer target, this one has "
            f"{target.num_layers}", "use a draft trained for this target")
    if max(cfg.target_layer_ids) >= target.num_layers - 1:
        raise ModelMismatchError(
            f"{source}: draft taps target layer {max(cfg.target_layer_ids)} but the target has "
            f"{target.num_layers} layers (the last is not tappable)", "use a draft trained for this target")


def read_draft_config(folder: Path, source: str | None = None) -> DraftConfig:
    """A draft folder's config.json, read strictly and typed (CheckpointError naming `source`)."""
    cfg_path = folder / "config.json"
    where = source or str(cfg_path)
    if not cfg_path.is_file():
        raise CheckpointError(f"{source or folder}: no config.json", "a DeepSpec draft folder holds config.json")
    try:
        raw = strict_loads(cfg_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:  # StrictJSONError is a ValueError
        raise CheckpointError(f"{where}: not valid JSON ({exc})", "fix or re-download config.json") from None
    return DraftConfig.from_dict(raw, where)


def load_draft(source: str | os.PathLike, target: Any | None = None, revision: str | None = None,
               dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> DSparkDraft:
    """Load a DSpark/DFlash draft of any known format (models/draft_formats: DeepSpec, speculators,
    SpecForge, ModelOpt); borrow embed/LM head from `target` (a TargetAdapter)."""
    folder = resolve_folder(source, revision)
    check_readable(folder)  # a file there that we may not read is no missing or damaged file
    canon = draft_formats.read(folder)  # any known format, in the canonical names and conventions
    cfg, state = canon.config, dict(canon.tensors)
    # every tensor's name, shape and finiteness was checked against the config by draft_formats.read
    if target is not None:
        check_compatible(cfg, target, str(folder))
    for name in BORROWED:
        if name not in state and target is None:
            raise CheckpointError(f"{folder}: missing tensor {name}",
                                  f"pass {option('target')} so the embedding/LM head can be borrowed")
    missing_ok = [k for k in BORROWED if k not in state]
    draft = DSparkDraft(cfg)
    draft.load_state_dict({k: v for k, v in state.items()}, strict=False)
    if target is not None:
        draft.share_target_embeddings(target.embed_tokens(), target.lm_head())
    elif missing_ok:
        raise CheckpointError(f"{folder}: has no {missing_ok[0]}", "pass the target so it can be borrowed")
    if target is not None:
        device, dtype = device or target.device, dtype or target.dtype
    return draft.to(device=device or "cpu", dtype=dtype or torch.float32).eval()


def check_draft_destination(out: str | os.PathLike, overwrite: bool) -> Path:
    """Validate an output folder before any work: absent, or (with overwrite) a previous draft of ours."""
    out = Path(out)
    if str(out) in ("", "."):
        raise InputError("the draft folder is empty or '.'", "name a new folder for the draft")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InputError(f"{out} exists and is not a folder", "choose a new folder for the draft")
    why = cannot_create(out)
    if why:
        raise InputError(f"{out} cannot be created: {why}", "choose a folder you can write to")
    if out.exists():
        if not overwrite:
            raise InputError(f"{out} already exists", "choose another folder or remove it")
        why = replace_refusal(out, as_folder=True)
        if why:
            raise InputError(f"{out} {why}; refusing to replace it", "choose a new folder (nothing was changed)")
    return out


def save_draft(draft: DSparkDraft, out: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
               include_embeddings: bool = False, extra_config: dict[str, Any] | None = None,
               overwrite: bool = False) -> Path:
    """Write `draft` as a DeepSpec checkpoint folder, atomically.

    With `overwrite`, an existing folder is replaced only if this command wrote it there
    (`files.ledger`), and the swap is atomic: readers see the old draft or the new one, even
    after a kill (`files.commit`)."""
    out = check_draft_destination(out, overwrite)
    sd = {}
    for k, v in draft.state_dict().items():
        if k.startswith("rotary.") or (k in BORROWED and not include_embeddings):
            continue
        v = v.detach().to(device="cpu")
        sd[k] = (v.to(dtype=dtype) if v.is_floating_point() else v).contiguous()
    return _write_draft_folder(out, sd, draft.cfg.to_dict() | (extra_config or {}))


def save_draft_for_vllm(draft: DSparkDraft, out: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                        extra_config: dict[str, Any] | None = None, overwrite: bool = False) -> Path:
    """Write a reduced-vocabulary draft in the form vLLM's `Qwen3DSparkForCausalLM.load_weights`
    reads (vllm/model_executor/models/qwen3_dspark.py): the index map as `d2t` [K] offsets
    (target id = draft id + d2t[draft id], EAGLE-3's convention) instead of `draft_vocab_ids`,
    and the head's K rows `lm_head.weight` [K, H], which vLLM requires of a reduced draft (it
    cannot share the target's full head). Everything else is written as `save_draft` does;
    config.json keeps `draft_vocab_size` K, the name vLLM reads. SGLang cannot read this form."""
    if draft.draft_vocab_ids is None:
        raise InputError("vLLM's reduced form is for reduced-vocabulary drafts; this one covers the full "
                         "vocabulary", "serve the draft folder as it is")
    out = check_draft_destination(out, overwrite)
    ids = draft.draft_vocab_ids.detach().to(device="cpu", dtype=torch.int64)  # [K] target ids
    sd = {}
    for k, v in draft.state_dict().items():
        if k.startswith("rotary.") or k in ("embed_tokens.weight", "draft_vocab_ids"):
            continue
        v = v.detach().to(device="cpu")
        sd[k] = (v.to(dtype=dtype) if v.is_floating_point() else v).contiguous()
    if tuple(sd["lm_head.weight"].shape) != (ids.numel(), draft.cfg.hidden_size):
        raise InputError(f"the draft's head has shape {tuple(sd['lm_head.weight'].shape)}, expected "
                         f"[{ids.numel()}, {draft.cfg.hidden_size}]", "load the draft with its target")
    sd["d2t"] = (ids - torch.arange(ids.numel(), dtype=torch.int64)).contiguous()  # [K]
    return _write_draft_folder(out, sd, draft.cfg.to_dict() | (extra_config or {}))


def _write_draft_folder(out: Path, sd: dict[str, torch.Tensor], cfg: dict[str, Any]) -> Path:
    """config.json + model.safetensors into `out` (checked by check_draft_destination), atomically:
    readers see the old folder or the new one, and so does the next run after a kill."""
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        save_file(sd, str(tmp / SINGLE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(finite(cfg), indent=2, allow_nan=False) + "\n")
    return out


def random_draft_config(target: Any, *, num_layers: int = 1, block_size: int = 5, markov_rank: int = 64,
                        markov_head_type: str = "vanilla", confidence: bool = True,
                        layer_ids: list[int] | None = None, mask_token_id: int = 0,
                        intermediate_size: int | None = None, draft_vocab_size: int = 0) -> DraftConfig:
    """A draft config shaped for `target` (TargetAdapter); taps default to low/middle/high layers."""
    L = target.num_layers
    tc = target.text_config
    taps = layer_ids or sorted({i for i in (1, L // 2, L - 3) if 0 <= i <= L - 2} or {max(0, L - 2)})
    base = tc.to_dict()
    base["architectures"] = ["Qwen3DSparkModel"]  # a draft, not a copy of the target's class
    base.update(
        num_hidden_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=taps, num_target_layers=L, markov_rank=markov_rank,
        markov_head_type=markov_head_type, enable_confidence_head=confidence,
        confidence_head_with_markov=confidence and markov_rank > 0, vocab_size=target.vocab_size,
        intermediate_size=intermediate_size or int(tc.intermediate_size), draft_vocab_size=draft_vocab_size,
    )
    rp = base.get("rope_parameters") or {}
    base.setdefault("rope_theta", (rp.get("rope_theta") if isinstance(rp, dict) else None) or 10000.0)
    base.pop("rope_parameters", None)
    base.pop("rope_scaling", None)
    return DraftConfig.from_dict(base, "random draft")


@torch.no_grad()
def init_weights(draft: DSparkDraft, generator: torch.Generator, for_training: bool = False) -> None:
    """The one random initialisation of a draft: every parameter but the norms (left at one) drawn
    N(0, 0.02) from `generator`, in parameter order. `for_training`: biases, the Markov output
    projection W2 and the confidence head start at zero instead (and draw nothing), so training
    starts from the plain backbone and σ(c) = ½."""
    for name, p in draft.named_parameters():
        if name.endswith("norm.weight"):
            continue
        if for_training and (name.endswith(".bias") or name == "markov_head.markov_w2.weight"
                             or name.startswith("confidence_head.")):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)


def random_draft(target: Any, seed: int = 0, **kw: Any) -> DSparkDraft:
    """A freshly initialised draft for `target` (untrained: for plumbing and tests)."""
    draft = DSparkDraft(random_draft_config(target, **kw))
    init_weights(draft, torch.Generator().manual_seed(seed))
    draft.share_target_embeddings(target.embed_tokens(), target.lm_head())
    return draft.to(device=target.device, dtype=target.dtype).eval()
