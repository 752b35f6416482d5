"""Placeholder: this command group is being written."""

import typer


def register(app: typer.Typer) -> None:
    return None
