"""The launch script serve-config writes: shell quoting that refuses control characters, and the
header that marks a script as ours (a file without it is never replaced).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from dsparkctl.errors import InputError, option


def refuse_control_characters(what: str, value: str) -> str:
    """`value` unchanged when it holds no control character (newline, carriage return, tab, escape,
    NUL, DEL, other Unicode controls and line/paragraph separators); otherwise an InputError naming
    `what`. Anything that reaches a script or a printed command passes here first: quoting keeps
    a value one word, but a newline would still end a comment line and run what follows."""
    import unicodedata

    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")]
    if bad:
        raise InputError(f"{what} {value!r} holds the control character {bad[0]!r}, which a shell script cannot "
                         "carry safely", "rename it (or pass a path without control characters)")
    return value


def shell_word(value: str, what: str = "a value") -> str:
    """One shell word for `value`: control characters refused, everything else quoted."""
    return shlex.quote(refuse_control_characters(what, str(value)))


def shell_line(env: dict[str, str], argv: list[str]) -> str:
    return " ".join([f"{k}={shell_word(v, k)}" for k, v in env.items()] + [shell_word(a) for a in argv])


SCRIPT_HEADER = "#!/usr/bin/env bash\n# written by dsparkctl serve-config\n"


def check_script_destination(path: Path) -> None:
    """The script (`ServeSpec.out`) may replace a script serve-config wrote, never another file."""
    if path.is_file():
        with open(path, "rb") as fh:
            head = fh.read(len(SCRIPT_HEADER))
        if head != SCRIPT_HEADER.encode():
            raise InputError(f"{path} exists and is not a script serve-config wrote; refusing to overwrite it",
                             f"choose a new file for {option('out')}")


def check_target_id(tid: str) -> None:
    """A target name the server can take: a hub id or a path, one line, no spaces."""
    if not tid.strip() or tid.startswith("-") or any(c.isspace() or not c.isprintable() for c in tid):
        raise InputError(f"{option('target_id')} {tid!r} must be a non-empty hub id or path without spaces or "
                         "control characters, not starting with '-'", f"e.g. {option('target_id')} Qwen/Qwen3-8B")
