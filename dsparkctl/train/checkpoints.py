"""A training run's checkpoints: written atomically, read back as untrusted input.

Run folder (outside the repo; `runs_dir/<recipe name>-<recipe hash>/`):
    checkpoints/step_000100/   draft.safetensors (fp32 trainable tensors) + state.pt
                               (optimizer, step, sampler generator state; loaded weights_only)
    latest.json                the newest complete checkpoint
    log.jsonl                  one line per logged step (loss parts, lr, seconds by phase)
    final/                     the trained draft in DeepSpec format (bf16, no embed/lm_head)
A checkpoint folder is complete or absent (written atomically), so a killed run resumes at the
last checkpoint. Every file of the folder is validated like user input before it is used: a
damaged run folder is refused in one line naming the file (`damaged`).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dsparkctl.distributed import world
from dsparkctl.errors import InputError, option
from dsparkctl.files.atomic import atomic_dir, write_json
from dsparkctl.files.os_errors import full_disk_error
from dsparkctl.files.ownership import regular_file
from dsparkctl.strict_json import loads

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


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def write_checkpoint(run_dir: Path, step: int, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
                     gen: torch.Generator, recipe_digest: str, keep: Iterable[int]) -> Path:
    """Write step `step`'s checkpoint folder atomically, point latest.json at it, and remove our
    other checkpoint folders but those of the `keep` steps. Returns the folder."""
    path = checkpoint_dir(run_dir, step)
    if not world().main:  # rank 0 alone writes; every rank holds the same state
        return path
    if path.exists():
        shutil.rmtree(path)
    try:
        with atomic_dir(path) as tmp:
            save_file({n: p.detach().contiguous() for n, p in params.items()}, str(tmp / "draft.safetensors"))
            with open(tmp / "state.pt", "wb") as fh:
                torch.save({"step": step, "optimizer": opt.state_dict(), "generator": gen.get_state(),
                            "recipe_digest": recipe_digest}, fh)
    except RuntimeError as exc:  # torch.save on a full disk: "unexpected pos ...", no errno
        full = full_disk_error(exc, run_dir)
        if full is None:
            raise
        raise full from exc
    write_json(run_dir / "latest.json", {"step": step, "path": path.name})
    kept = set(keep) | {step}
    for old, s in checkpoint_folders(run_dir):  # only names of ours: a stray folder is left alone
        if s not in kept:
            shutil.rmtree(old, ignore_errors=True)
    return path


def restore_latest(run_dir: Path, params: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer,
                   gen: torch.Generator, recipe_digest: str) -> int | None:
    """Load the newest checkpoint into `params`, `opt` and `gen`; its step, or None when the run
    has none. Every file is validated like user input (`read_latest`, `read_checkpoint`): a
    damaged run folder is refused in one line naming the file, before anything here changes."""
    latest = read_latest(run_dir)
    if latest is None:
        return None
    step, path = latest
    tensors, state = read_checkpoint(path, step, params, opt, gen)
    if state["recipe_digest"] != recipe_digest:
        raise InputError(f"{path}: checkpoint was made with a different draft/optim recipe",
                         f"resume with the same recipe, or start a fresh run without {option('resume')}")
    opt_before = opt.state_dict()
    gen_before = gen.get_state()
    try:
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        opt.load_state_dict(opt_before)
        gen.set_state(gen_before)
        raise damaged(path / "state.pt", f"optimizer or sampler state does not fit this draft "
                      f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
    return step
