"""Checks a command runs before any work: every output it will write, against every input it reads.

A command that computes for minutes and then cannot write its result has wasted the minutes; one
that writes two of three outputs and fails on the third leaves a mix. So each command names all
its outputs first and `check_outputs` refuses, before anything runs:
  - a file output that exists as a folder (or a FIFO, a device), a folder output that is a file;
  - a file output that exists and is not ours (a link, or a regular file without our marker,
    `files.ownership.replace_refusal`): a user's file is never replaced;
  - a path whose nearest existing parent is a file, or a folder we may not write to;
  - a figure whose suffix matplotlib cannot write (`--plot j.xyz`);
  - two outputs that are the same file, or an output that is one of the command's inputs
    (`local_inputs` names them, with the folders the defaults stand for).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dsparkctl.checkpoint.hub import check_repo_id
from dsparkctl.errors import UsageError
from dsparkctl.files.atomic import cannot_create
from dsparkctl.files.commit import recover
from dsparkctl.files.ownership import inside_another_output, replace_refusal
from dsparkctl.math.policy_spec import parse_spec
from dsparkctl.models.draft_io import check_local_source
from dsparkctl.strict_json import read
from dsparkctl.models.embedded import EMBEDDED_NAME, cache_root
from dsparkctl.models.loading import default_draft_dir, is_default_draft, is_embedded, names_a_place


@dataclass(frozen=True)
class Output:
    path: Path
    option: str  # what messages call it: the CLI passes its flag ("--out"), the library its field name
    kind: str = "file"  # "file" | "figure" | "folder"
    whole: bool = True  # a folder written as one unit (a draft, an extract); False: a place for named files


def figure_formats() -> list[str]:
    """Suffixes (without the dot) that `plots.save_figure` can write on this machine (`can_write_figure`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return [f for f in sorted(FigureCanvasAgg.get_supported_filetypes()) if can_write_figure(f)]


@functools.lru_cache(maxsize=None)
def can_write_figure(fmt: str) -> bool:
    """Whether `save_figure` can write format `fmt`: a small figure with text, a legend and our
    metadata is rendered to memory, as the real one will be. matplotlib lists formats it cannot
    write without a program or package this machine may lack (pgf needs LaTeX, jpg/webp Pillow)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from dsparkctl.plots import FIGURE_MARK, pyplot

    if fmt not in FigureCanvasAgg.get_supported_filetypes():
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1, 1))
    mpl_log = logging.getLogger("matplotlib")
    level = mpl_log.level
    mpl_log.setLevel(logging.ERROR)  # a probe's format notes (PostScript and transparency) are no user's business
    try:
        ax.plot([0, 1], [0, 1], label="τ ≤ γ")
        ax.set_title("β")
        ax.legend()
        fig.savefig(io.BytesIO(), format=fmt, dpi=10, bbox_inches="tight", metadata=FIGURE_MARK.get(fmt))
        return True
    except Exception:  # noqa: BLE001 - whatever stops the writer (a missing program, package or font)
        return False
    finally:
        mpl_log.setLevel(level)
        plt.close(fig)


def check_outputs(outputs: Sequence[Output], inputs: Sequence[Path] = (),
                  derived: Callable[[Path], Sequence[Output]] | None = None) -> None:
    """Refuse (UsageError naming the option) any output that could not be written or would clobber.
    `derived(first output's path)`: the outputs named after the first one by default (`<out>.png`),
    checked after it, so a bad first path fails on its own terms before anything is named after it."""
    seen: dict[Path, Output] = {}
    queue = list(outputs)
    for n, o in enumerate(queue):
        for folder in {o.path.parent, o.path} if o.kind == "folder" else {o.path.parent}:
            recover(folder)  # a run killed during its commit there: finished or undone before we judge
        _check_one(o)
        if n == 0 and derived is not None:
            queue.extend(derived(o.path))
        key = o.path.resolve()
        if key in seen:
            raise UsageError(f"{o.option} {o.path} is the same path as {seen[key].option} {seen[key].path}",
                             hint="give each output its own path")
        for k, other in seen.items():  # one output inside another's folder: the two would fight over it
            inner, outer = (o, other) if other.kind == "folder" and other.whole and key.is_relative_to(k) else \
                (other, o) if o.kind == "folder" and o.whole and k.is_relative_to(key) else (None, None)
            if inner is not None and outer is not None:
                raise UsageError(f"{inner.option} {inner.path} is inside {outer.option} {outer.path}",
                                 hint="give each output a place of its own")
        seen[key] = o
        for i in inputs:
            if key == i.resolve() or (o.path.exists() and i.exists() and os.path.samefile(o.path, i)):
                raise UsageError(f"{o.option} {o.path} is one of the inputs and would be overwritten",
                                 hint="write the output somewhere else")
            if i.is_dir() and key.is_relative_to(i.resolve()):
                raise UsageError(f"{o.option} {o.path} is inside the input folder {i}; writing there could "
                                 "overwrite or corrupt the model", hint="write the output somewhere else")
        why = inside_another_output(o.path, as_folder=o.kind == "folder")
        if why:
            raise UsageError(f"{o.option} {o.path} {why}", hint="write it somewhere else")
        if o.kind != "folder":  # a new path, or a regular file we wrote: never a user's file, link or device
            why = replace_refusal(o.path)
            if why:
                raise UsageError(f"{o.option} {o.path} {why}; refusing to replace it",
                                 hint="choose a new path, or remove it yourself")


def _check_one(o: Output) -> None:
    p = o.path
    if str(p) in ("", "."):  # typer reads an empty value as Path("."): the two cannot be told apart
        example = "./out" if o.kind == "folder" else "./out.json" if o.kind == "file" else "./figure.png"
        raise UsageError(f"{o.option} is empty or the current folder itself",
                         hint=f"give {o.option} a path of its own, e.g. {example}")
    if p.exists():
        if o.kind == "folder" and not p.is_dir():
            raise UsageError(f"{o.option} {p} exists and is not a folder", hint="give a folder path")
        if o.kind != "folder" and not p.is_file():
            what = "a folder" if p.is_dir() else "not a regular file"
            raise UsageError(f"{o.option} {p} is {what}", hint="give a file path, e.g. <folder>/result.json")
    if o.kind == "figure":
        fmt = p.suffix.lower().lstrip(".") or "png"  # save_figure's rule
        if not can_write_figure(fmt):
            formats = figure_formats()
            raise UsageError(f"{o.option} {p}: cannot write figures of type {p.suffix!r}",
                             hint=f"use one of {', '.join('.' + f for f in formats)}")
    why = cannot_create(p)
    if why:
        raise UsageError(f"{o.option} {p} cannot be created: {why}", hint="choose a folder you can write to")


def local_inputs(*specs: str | Path | None, target: str | None | bool = False,
                 drafts: Sequence[str | None] = ()) -> list[Path]:
    """The arguments that name local files or folders, plus the folders the defaults stand for:
    `target` None/"embedded" is the embedded target's converted folder, a draft None/"default" the
    shipped draft. (Hub ids drop out: their cache is the hub library's.)"""

    named: list[str | Path | None] = list(specs)
    if target is not False:
        named.append(cache_root() / EMBEDDED_NAME if is_embedded(target) else target)
    for d in drafts:
        named.append(default_draft_dir() if is_default_draft(d) else d)
    paths = []
    for spec in named:
        if not names_a_place(spec):
            continue
        p = Path(spec).expanduser()
        if p.exists():
            paths.append(p)
    return paths


def named_inputs(*, policy: str | None = None, sps_table: Path | None = None, calibration: Path | None = None,
                 target: str | None = None, drafts: Sequence[str | None] = ()) -> None:
    """What can be checked of the named inputs before any model loads: a policy's spelling, that
    the SPS table and calibration files and local model folders exist (their content is read later)."""
    if policy:
        parse_spec(policy)
    for path, what, fix in ((sps_table, "SPS table", "profile one with `dsparkctl profile-sps`"),
                            (calibration, "calibration file", "write one with `dsparkctl calibrate`")):
        if path is not None:
            read(Path(path).expanduser(), what, fix)  # there, and strict JSON (its fields are read later)
    for spec in (target, *drafts):
        if names_a_place(spec) and not is_embedded(spec):
            check_local_source(str(spec))
            if not Path(str(spec)).expanduser().is_dir():
                check_repo_id(str(spec))  # a hub id that could never exist, before the target loads

