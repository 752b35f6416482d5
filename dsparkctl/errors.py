"""Domain exceptions. The library raises these; the CLI turns them into one-line messages.

Every error carries a `hint`: one sentence telling the user how to fix the problem.

A message that names one of the caller's inputs names it with `option("max_new_tokens")`: a Python
caller reads the field's own name (`max_new_tokens must be >= 1`), a command-line user the flag of
the command that ran (`--max-new-tokens must be >= 1`). The CLI renders the names in one place
(`cli.guard.guarded`), so no library function takes a table of flags and no message names a flag
the command does not have.
"""

from __future__ import annotations

import re
import secrets
from typing import Mapping

# A private-use character and a per-process nonce: a value interpolated into a message (a user's
# path, say) cannot pass for a mark, so only the message's own option names are rendered.
_MARK = "\ue000" + secrets.token_hex(6)
_OPTION = re.compile(f"{_MARK}([A-Za-z_][A-Za-z0-9_]*){_MARK}")


def option(field: str) -> str:
    """How a message names the caller's input `field` (rendered by `render`)."""
    return f"{_MARK}{field}{_MARK}"


def render(text: str, names: Mapping[str, str] | None = None) -> str:
    """`text` with each `option(field)` replaced by `names[field]`, or by the field's own name."""
    names = names or {}
    return _OPTION.sub(lambda m: names.get(m[1], m[1]), text)


class DsparkError(Exception):
    """Base class for every error the toolkit reports to a user."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        self.raw = (message, hint)  # with the option marks, for `one_line(names)`
        self.message = render(message)
        self.hint = render(hint) if hint else hint
        super().__init__(self.message)

    def one_line(self, names: Mapping[str, str] | None = None) -> str:
        """The message and its fix on one line, each option named as `names` says (default: its field)."""
        message, hint = (render(t, names) if t else t for t in self.raw)
        text = message.replace("\n", " ")
        return f"{text} (fix: {hint})" if hint else text


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
