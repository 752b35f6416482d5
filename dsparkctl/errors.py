"""Domain exceptions. The library raises these; the CLI turns them into one-line messages.

Every error carries a `hint`: one sentence telling the user how to fix the problem.
"""

from __future__ import annotations


class DsparkError(Exception):
    """Base class for every error the toolkit reports to a user."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message.replace("\n", " ")
        return f"{text} (fix: {self.hint})" if self.hint else text


class UsageError(DsparkError):
    """Nonsense options or arguments."""

    exit_code = 2


class InputError(DsparkError):
    """A file or dataset the user pointed at is missing, empty or malformed."""

    exit_code = 2


class CheckpointError(DsparkError):
    """A checkpoint is corrupt, unsafe, or of an unknown/mismatched layout."""

    exit_code = 3


class ModelMismatchError(DsparkError):
    """Draft and target disagree (vocab, hidden size, tokenizer, tapped layers)."""

    exit_code = 3
