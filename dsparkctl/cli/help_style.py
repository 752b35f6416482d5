"""How `--help` shows what each option takes, for every command (main.py makes `HelpGroup` the
app's class and `restyle_commands` each command's `HelpCommand`).

Typer (0.2x) writes each parameter's Python type: a flag reads `--json <bool>` as if it took a
value, a repeatable option `--draft <list[str]>`, a bounded number `<int range>`. Here a flag
shows no value, a repeatable option or a variadic argument the type of one value (its help says
how to repeat it), a bounded number its type (the range follows in brackets), and an argument
its name in capitals (`SOURCE`, as error messages name it). An older typer, which does not
write types this way, is left as it is.
"""

from __future__ import annotations

import re
from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

_LIST = re.compile(r"^<list\[(.*)\]>(\.\.\.)?$")


def shown_type(param: Any, shown: str | None) -> str | None:
    """What the help shows for `param`'s value, given what typer would show (`shown`)."""
    if getattr(param, "is_flag", False) or not shown:
        return None
    if m := _LIST.match(shown):  # one value's type: <list[Path]> is <path>, as a single Path shows
        shown = f"<{m.group(1).lower() if m.group(1).isidentifier() else m.group(1)}>"
    return shown.replace(" range>", ">")


class HelpOption(TyperOption):
    def display_type_rich(self, ctx: Any) -> str | None:
        return shown_type(self, super().display_type_rich(ctx))


class HelpArgument(TyperArgument):
    def display_type_rich(self, ctx: Any) -> str | None:
        return shown_type(self, super().display_type_rich(ctx))

    @property
    def display_name_raw(self) -> str:
        return self.metavar or (self.name or "").upper()


def restyle(params: list[Any]) -> None:
    """Give typer's own parameters the display above (they keep all else: the classes only add it)."""
    for p in params:
        if type(p) is TyperOption:
            p.__class__ = HelpOption
        elif type(p) is TyperArgument:
            p.__class__ = HelpArgument


class _Restyled:
    """A command or group whose parameters, its lazily made --help included, show the display above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        restyle(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        restyle([option])
        return option


class HelpCommand(_Restyled, TyperCommand):
    pass


class HelpGroup(_Restyled, TyperGroup):
    pass


def restyle_commands(app: Any) -> None:
    """Every command registered on `app` with typer's own class gets `HelpCommand` instead."""
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = HelpCommand
