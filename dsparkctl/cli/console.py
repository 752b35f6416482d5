"""Where output goes: results to stdout (a rich table, or strict JSON with `--json`), progress, notes
and errors to stderr; progress bars; user text never parsed as rich markup.
"""

from __future__ import annotations

import contextlib
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.text import Text

def robust_streams() -> None:
    """Printing never fails: on a stdout/stderr that cannot encode a character (PYTHONIOENCODING=ascii,
    a latin-1 terminal) the character is written as an escape (`\\xe9`) instead of raising after the
    work is done. Called once, by the entry point."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors="backslashreplace")


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


def print_json(obj: Any) -> None:
    """Write strict JSON to stdout, unstyled, one document (NaN/Infinity become null)."""
    from dsparkctl.distributed import world
    from dsparkctl.strict_json import finite

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
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

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


def note(message: str) -> None:
    """A note on stderr ("note: ..."), its options named as the running command names them."""
    from dsparkctl.errors import render

    err.print(styled(("note:", "yellow"), " ", render(message, STATE["names"])), highlight=False)
