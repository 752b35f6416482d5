"""The `dsparkctl` entry point: one Typer app; each command group registers itself."""

from __future__ import annotations

from typing import Annotated

import typer

from dsparkctl import __version__
from dsparkctl.cli import checkpoint, evaluate, generate, profile, schedule, serve, train
from dsparkctl.cli.console import STATE
from dsparkctl.cli.help_style import HelpGroup, restyle_commands

app = typer.Typer(
    name="dsparkctl",
    cls=HelpGroup,
    help="DSpark speculative decoding toolkit: a small draft model proposes a block of tokens, the "
    "target model checks them in one forward and keeps the ones it would have produced itself, so the "
    "output is the target's own, only faster. Inspect, fetch and convert drafts; generate; measure "
    "acceptance; calibrate; profile; sweep schedulers; train; serve.",
    epilog="Terms: γ = draft block size (tokens proposed per round); τ = tokens produced per target "
    "forward (accepted + 1); acceptance = how often the target keeps a drafted position; SPS table = "
    "the engine's steps per second by batch size (profile-sps); policy = how many drafted tokens each "
    "round verifies. Each command: dsparkctl COMMAND --help.",
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
    from dsparkctl.errors import DsparkError

    try:
        if distributed.env_world().distributed:  # launched by torchrun: join the group, same argv everywhere
            distributed.init()
            distributed.check_same_everywhere()
    except DsparkError as exc:  # every rank sees the same verdict: each says it in one line, leaves the group, exits
        import sys

        from dsparkctl.cli.console import err, error_line

        w = distributed.env_world()
        label = f"rank {w.rank} error:" if w.distributed else "error:"
        err.quiet = False
        err.print(error_line(label, exc.one_line()), highlight=False)
        distributed.shutdown(barrier=False)
        sys.stderr.flush()
        raise typer.Exit(exc.exit_code) from None


for _module in (checkpoint, generate, evaluate, schedule, profile, train, serve):
    _module.register(app)
restyle_commands(app)  # every command's --help shows a flag as a flag (help_style.py)


def _click_exceptions() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(no-args-is-help, usage error, abort) classes of the click in use: recent typer vendors its
    own copy (typer._click, with Abort in typer.exceptions), older typer uses click itself."""
    import importlib

    mods = []
    for name in ("typer._click.exceptions", "typer.exceptions", "click.exceptions"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass

    def classes(attr: str) -> tuple[type, ...]:
        return tuple(getattr(m, attr) for m in mods if isinstance(getattr(m, attr, None), type))

    return classes("NoArgsIsHelpError"), classes("UsageError"), classes("Abort")


def _leave_group() -> None:
    """Under torchrun, a rank that succeeded leaves the process group before the interpreter exits
    (after a barrier, so every rank has finished talking). A failed rank leaves it alone: it exits
    at once, torchrun ends its peers, and no teardown can block on a peer still in a collective."""
    from dsparkctl import distributed

    if distributed.world().distributed:
        distributed.shutdown()


def main() -> None:
    """Run the app; a command-line mistake (unknown option, bad value) is one line on stderr, exit 2."""
    import signal
    import sys

    from dsparkctl.cli.console import robust_streams

    def before_the_command(signum: int, _frame: object) -> None:  # nothing is written yet: a quiet 130
        sys.stderr.write("interrupted before the command started; nothing was written\n")
        sys.exit(130)
    for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if s is not None:
            signal.signal(s, before_the_command)  # the command's own handlers take over (signals.py)
    robust_streams()
    no_args, usage, aborted = _click_exceptions()
    try:
        code = app(standalone_mode=False)
        if not code:
            _leave_group()
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
    except aborted:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
