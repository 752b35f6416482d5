"""Shared CLI plumbing: typed options, output routing, and the one place errors become messages.

Results go to stdout (a rich table, or JSON with `--json`); progress and logs go to stderr.
Every command is a function decorated with `@guarded` where it is defined (errors -> one line,
seed checked, signals unwind) and registered by its module's `register(app)`; the JSON flag is
always the parameter `json_out: JsonOpt`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Mapping, Sequence, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from dsparkctl.engine.session import CPU_KERNELS
from dsparkctl.errors import DsparkError, UsageError
from dsparkctl.models.loading import DTYPES

# Markup is off on both consoles: user text (paths, prompts, config values) is never parsed as
# rich markup. Our own styling goes through `styled`, which builds Text objects.
out = Console(soft_wrap=True, markup=False)  # results
err = Console(stderr=True, soft_wrap=True, markup=False)  # progress, warnings, errors (one line each)


def styled(*parts: str | tuple[str, str]) -> Text:
    """Text from plain strings and (text, style) pairs; nothing is parsed as markup."""
    t = Text()
    for p in parts:
        if isinstance(p, tuple):
            t.append(p[0], style=p[1])
        else:
            t.append(p)
    return t


def error_line(label: str, message: str) -> Text:
    return styled((label, "bold red"), " ", message.replace("\n", " "))

STATE: dict[str, Any] = {"debug": False, "names": {}}  # --debug; how the running command names its inputs

F = TypeVar("F", bound=Callable[..., Any])


def choices(name: str, values: Sequence[str]) -> Any:
    """An option's choice type built from the library's tuple of names (so the two cannot drift);
    a member is named as its value with "-" as "_" (`Mode.teacher_forced` is "teacher-forced")."""
    return Enum(name, {v.replace("-", "_"): v for v in values}, type=str)


Device = choices("Device", ("auto", "cpu", "cuda"))
DType = choices("DType", DTYPES)
CpuKernels = choices("CpuKernels", CPU_KERNELS)


JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed (all randomness is seeded).")]
DeviceOpt = Annotated[Device, typer.Option("--device", help="Where to run the models.")]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Model dtype (auto: bf16 on CUDA, fp32 on CPU).")]
_REVISION = re.compile(r"^(?!.*\.\.)(?!.*//)(?!.*/\.)[A-Za-z0-9_][A-Za-z0-9_.\-/]{0,254}$")


def _check_revision(value: str | None) -> str | None:
    """A git ref or commit the hub could hold: refused here, not after retries against the hub."""
    if value is not None and (not _REVISION.match(value) or value.endswith(("/", ".", ".lock"))):
        raise typer.BadParameter(f"{value!r} is not a branch, tag or commit (e.g. main, v1.0, refs/pr/1, or a "
                                 "40-hex commit)")
    return value


RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Hub revision (branch, tag or commit).",
                                                 callback=_check_revision)]
TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model repos to run their own "
                                                  "code (off by default).")]
TargetOpt = Annotated[str | None, typer.Option("--target", help="Target model: folder or hub id (default: the "
                                               "embedded SmolLM2-135M-Instruct).")]
DraftOpt = Annotated[str | None, typer.Option("--draft", help="DeepSpec draft folder or hub id; 'random' for an "
                                              "untrained one (default: the shipped draft for the embedded target).")]
TargetParallelOpt = Annotated[str, typer.Option("--target-parallel", help="For a target too big for one device: "
                                                "device-map (one process, layers over the visible GPUs) or tp "
                                                "(under torchrun, each rank a shard; the ranks then share the work).")]
CpuKernelsOpt = Annotated[CpuKernels, typer.Option("--cpu-kernels", help="CPU fp32 only: packed = linear weights "
                                                  "packed once for oneDNN (on many CPUs faster, above all for the "
                                                  "multi-token verify forward); stock = torch's default kernels; "
                                                  "auto = each forward on whichever of the two this CPU runs faster "
                                                  "at its row count (timed once per machine and model, cached).")]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", help="Sampling temperature; 0 = greedy "
                                                     "(default 0, or the --preset's).")]
MaxNewTokensOpt = Annotated[int | None, typer.Option("--max-new-tokens", help="Tokens to generate per prompt "
                                                     "(default 128, or the --preset's).")]
PresetOpt = Annotated[str | None, typer.Option("--preset", help="Another tool's evaluation settings, so numbers "
                                               "compare with its tables: deepspec (T=1.0, 2048 tokens, chat template, "
                                               "DeepSpec's HumanEval instruction). Explicit options win.")]


INT_LIST_MAX = 1 << 16  # no load level, request count or token count we profile or sweep is larger


def int_list(text: str, option: str, maximum: int = INT_LIST_MAX) -> list[int]:
    """A comma-separated list of positive integers up to `maximum` given to `option` (e.g.
    "--requests 1,2,4"): a typo such as 99999999999 is refused here, not by an allocation of
    terabytes later."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{option} must be comma-separated integers, got {text!r}", f"e.g. {option} 1,2,4") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{option} must be positive integers, got {text!r}", f"e.g. {option} 1,2,4")
    big = [v for v in vals if v > maximum]
    if big:
        raise UsageError(f"{option} {big[0]} is larger than {maximum}", f"use values in 1..{maximum}, e.g. {option} 1,2,4")
    return vals


def print_json(obj: Any) -> None:
    """Write strict JSON to stdout, unstyled, one document (NaN/Infinity become null)."""
    from dsparkctl.strict_json import finite

    from dsparkctl.distributed import world

    if not world().main:  # under torchrun only rank 0 reports
        return
    text = json.dumps(finite(json.loads(json.dumps(obj, default=_json_default))), indent=2, allow_nan=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, Enum):
        return o.value
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def show_progress() -> bool:
    """Progress bars only for humans on a terminal."""
    return err.is_terminal


@contextlib.contextmanager
def progress_bar(label: str, total: int | None, unit: str = "", enabled: bool = True, describe: bool = False,
                 transfer: bool = False) -> Iterator[Callable[..., None]]:
    """The one progress bar: on a terminal (stderr) a transient rich bar, elsewhere nothing.

    Yields `update(completed=None, advance=0, description=None, total=None)` (safe to call from
    threads); `total=None` here hides the bar until an update gives the total (a library entry
    that learns it after loading models); `describe` adds a column for the description,
    `transfer` counts bytes and shows the speed."""
    if not (enabled and show_progress()):
        yield lambda completed=None, advance=0, description=None, total=None: None
        return
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    cols = [TextColumn(label), BarColumn()]
    cols += ([DownloadColumn(), TransferSpeedColumn()] if transfer
             else [MofNCompleteColumn(), TextColumn(unit), TimeRemainingColumn()])
    if describe:
        cols.append(TextColumn("{task.description}", markup=False))
    with Progress(*cols, console=err, transient=True) as progress:
        task = progress.add_task("", total=total, visible=total is not None)

        def update(completed: float | None = None, advance: float = 0, description: str | None = None,
                   total: float | None = None) -> None:
            progress.update(task, completed=completed, advance=advance or None, description=description,
                            total=total, visible=True if total is not None else None)
        yield update


ENVIRONMENT_HINTS = {"the disk is full": "free some space (or write elsewhere) and run it again",
                     "the disk quota is exhausted": "free some space (or write elsewhere) and run it again",
                     "the file system is read-only": "write to a folder on a writable file system",
                     "permission denied": "write to a folder you may write to",
                     "operation not permitted": "write to a folder you may write to",
                     "the file is too large for the file system": "write to another file system"}


def _environment_error(exc: BaseException, say: Callable[..., None], label: str) -> None:
    """A full disk, a read-only file system, a missing permission (as an OSError, or wrapped in a
    library's own exception): one line with a fix, exit 2 (the writers are atomic: nothing
    partial is left). Returns when `exc` is none of those."""
    from dsparkctl.fsutil import os_error_words

    words = os_error_words(exc)
    if words is None or words[0].split(" (")[0] not in ENVIRONMENT_HINTS:
        return
    say(error_line(label, f"{words[0]} (fix: {ENVIRONMENT_HINTS[words[0].split(' (')[0]]})"), highlight=False)
    raise typer.Exit(2) from None


def option_names(fn: Callable[..., Any], fields: Mapping[str, str] | None = None) -> dict[str, str]:
    """How this command names each input in messages: parameter `max_new_tokens` → "--max-new-tokens"
    (its first long flag; the flag's own words are a key too, so `out_path` with "--out" is also
    "out"), an argument → its metavar ("PROMPTS"); `fields` maps a library field that the command
    takes under another name (`drafts` → its parameter "draft"), or from elsewhere than an option
    (`field` → "data.field in the recipe")."""
    import inspect
    import typing

    from typer.models import ArgumentInfo, OptionInfo

    hints = typing.get_type_hints(fn, include_extras=True)
    names: dict[str, str] = {}
    for p in inspect.signature(fn).parameters.values():
        info = next((m for m in getattr(hints.get(p.name), "__metadata__", ())
                     if isinstance(m, (OptionInfo, ArgumentInfo))), p.default)
        if isinstance(info, ArgumentInfo):
            names[p.name] = info.metavar or p.name.upper()
        elif isinstance(info, OptionInfo):
            given = (info.default, *(info.param_decls or ()))  # under Annotated the first flag is `default`
            decls = [d.split("/")[0] for d in given if isinstance(d, str) and d.startswith("--")]
            names[p.name] = decls[0] if decls else "--" + p.name.replace("_", "-")
    by_flag = {f[2:].replace("-", "_"): f for f in names.values() if f.startswith("--")}  # `out_path` is also "out"
    return by_flag | names | {field: names.get(param, param) for field, param in (fields or {}).items()}


def note(message: str) -> None:
    """A note on stderr ("note: ..."), its options named as the running command names them."""
    from dsparkctl.errors import render

    err.print(styled(("note:", "yellow"), " ", render(message, STATE["names"])), highlight=False)


def guarded(fn: F | None = None, *, fields: Mapping[str, str] | None = None) -> Any:
    """Run a command; map library errors to a one-line message and a non-zero exit. Messages name
    the library's fields (`errors.option`) as this command's flags (`option_names(fn, fields)`)."""
    if fn is None:
        return functools.partial(guarded, fields=fields)
    names = option_names(fn, fields)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from dsparkctl.distributed import world
        from dsparkctl.signals import terminate_as_interrupt

        w = world()
        if not w.main:  # under torchrun only rank 0 prints results and progress; every rank its own error
            import os
            out.file = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
            err.quiet = True


        def say(*a: Any, **k: Any) -> None:  # errors are printed on every rank
            err.quiet = False
            err.print(*a, **k)
        label = f"rank {w.rank} error:" if w.distributed else "error:"
        STATE["names"] = names
        try:
            if isinstance(kwargs.get("seed"), int):
                from dsparkctl.checks import check_seed
                check_seed(kwargs["seed"])
            with terminate_as_interrupt():  # SIGTERM/SIGHUP unwind like Ctrl-C: temp files are cleaned up
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except DsparkError as exc:
            if STATE["debug"]:
                raise
            say(error_line(label, exc.one_line(names)), highlight=False)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            from dsparkctl.fsutil import WRITTEN

            who = f"rank {w.rank} " if w.distributed else ""
            done = sorted({str(p) for p in WRITTEN if ".staged-" not in p.name})
            said = (f"; {len(done)} file(s) were complete before it, e.g. {done[-1]}; nothing partial was left"
                    if done else "; nothing was written" + (" by this rank" if w.distributed else ""))
            say(styled((f"{who}interrupted", "red"), said))
            raise typer.Exit(130) from None
        except (OSError, MemoryError) as exc:
            if STATE["debug"]:
                raise
            _environment_error(exc, say, label)
            say(error_line(label, f"{type(exc).__name__}: {exc}"), highlight=False)
            raise typer.Exit(1) from None
        except Exception as exc:  # noqa: BLE001 - last-resort one-liner
            if STATE["debug"]:
                raise
            _environment_error(exc, say, label)  # a library's wrapped "No space left on device" is no bug of ours
            msg = str(exc).splitlines()[0] if str(exc) else ""
            say(error_line("internal error:", f"{type(exc).__name__}: {msg} "
                                 "(fix: rerun with --debug for the traceback and report it)"), highlight=False)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]
