"""The `dsparkctl` entry point: one Typer app; each command group registers itself."""

from __future__ import annotations

from typing import Annotated

import typer

from dsparkctl import __version__
from dsparkctl.cli import checkpoint, evaluate, generate, profile, schedule, serve, train
from dsparkctl.cli.common import STATE

app = typer.Typer(
    name="dsparkctl",
    help="DSpark speculative decoding toolkit: inspect/extract drafts, generate, measure "
    "acceptance, calibrate confidence, profile steps/s and sweep schedulers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dsparkctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    STATE["debug"] = debug
    from dsparkctl import distributed

    if distributed.env_world().distributed:  # launched by torchrun: join the group, same argv everywhere
        distributed.init()
        distributed.check_same_everywhere()


for _module in (checkpoint, generate, evaluate, schedule, profile, train, serve):
    _module.register(app)


def _click_exceptions() -> list:
    """The exception modules of the click in use: recent typer vendors its own copy."""
    mods = []
    try:
        import typer._click.exceptions as vendored  # typer >= 0.2x

        mods.append(vendored)
    except ImportError:
        pass
    import click.exceptions

    return [*mods, click.exceptions]


def main() -> None:
    """Run the app; a command-line mistake (unknown option, bad value) is one line on stderr, exit 2."""
    import sys

    mods = _click_exceptions()
    no_args = tuple(m.NoArgsIsHelpError for m in mods if hasattr(m, "NoArgsIsHelpError"))
    usage = tuple(m.UsageError for m in mods)
    import typer.exceptions

    aborted = tuple(getattr(m, "Abort") for m in (*mods, typer.exceptions) if hasattr(m, "Abort"))
    try:
        code = app(standalone_mode=False)
    except no_args as exc:
        text = exc.ctx.get_help() if exc.ctx else None  # typer's rich help prints itself, returns ""
        if text:
            sys.stdout.write(text + "\n")
        sys.exit(0)
    except usage as exc:
        commands = {c.name for c in app.registered_commands}
        sub = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in commands else None
        where = exc.ctx.command_path if exc.ctx and exc.ctx.parent else f"dsparkctl {sub}" if sub else "dsparkctl"
        msg = " ".join(exc.format_message().split())
        sys.stderr.write(f"error: {msg} (see '{where} --help')\n")
        sys.exit(exc.exit_code)
    except aborted or ():
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
