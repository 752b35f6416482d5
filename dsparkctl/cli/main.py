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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
