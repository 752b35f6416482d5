"""The one place errors become messages: `@guarded` wraps every command (an error becomes one line
and its exit code, the seed is checked, signals unwind like Ctrl-C, `--debug` shows the traceback),
and library messages name the command's own flags (`option_names`).

Every command is a function decorated with `@guarded` where it is defined and registered by its
module's `register(app)`; the JSON flag is always the parameter `json_out: JsonOpt`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import typer

from dsparkctl.cli.console import STATE, err, error_line, out, styled
from dsparkctl.errors import DsparkError
from dsparkctl.files.ledger import set_command

F = TypeVar("F", bound=Callable[..., Any])


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
    from dsparkctl.files.os_errors import os_error_words

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


# Options that take a local folder or a hub id as a string: a leading "~" is a home folder, as for Path options
PATH_OR_ID = frozenset({"target", "draft", "dataset", "model", "offline_dataset", "offline_draft", "sources", "repo"})


def _home(value: Any, path_or_id: bool) -> Any:
    """`value` with a leading "~" expanded: the shell leaves it in `--out=~/x` (and in quotes)."""
    if isinstance(value, Path) and (str(value) == "~" or str(value).startswith("~/")):
        return value.expanduser()
    if path_or_id and isinstance(value, str) and (value == "~" or value.startswith("~/")):
        return str(Path(value).expanduser())
    if isinstance(value, (list, tuple)):
        return type(value)(_home(v, path_or_id) for v in value)
    return value


def prepared(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A command's arguments as its body takes them: every number in range (an int that fits int64,
    a finite float; `checks.check_number_range`) and every path with its "~" expanded."""
    from dsparkctl.checks import check_number_range

    for name, value in kwargs.items():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            check_number_range(v, name)
    return {name: _home(v, name in PATH_OR_ID) for name, v in kwargs.items()}


def interrupted_line(w: Any) -> Any:
    """What an interrupted command says: what was complete before it, or that nothing was written."""
    from dsparkctl.files.atomic import WRITTEN

    who = f"rank {w.rank} " if w.distributed else ""
    done = sorted({str(p) for p in WRITTEN})
    said = (f"; {len(done)} file(s) were complete before it, e.g. {done[-1]}; nothing partial was left"
            if done else "; nothing was written" + (" by this rank" if w.distributed else ""))
    return styled((f"{who}interrupted", "red"), said)


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
        set_command(fn.__name__.removesuffix("_cmd").replace("_", "-"))  # the writer the ledger records
        try:
            kwargs = prepared(kwargs)
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
            say(interrupted_line(w))
            raise typer.Exit(130) from None
        except (OSError, MemoryError) as exc:
            if STATE["debug"]:
                raise
            _environment_error(exc, say, label)
            say(error_line(label, f"{type(exc).__name__}: {exc} (fix: check that path and its permissions; "
                                  "--debug shows where it happened)"), highlight=False)
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
