"""What the interop scripts share, whichever side venv runs them (only the standard library here):
one ok/FAIL/note line per check, a failure's traceback on stderr, the failures counted."""

from __future__ import annotations

import sys
import traceback
from typing import Callable


class Note(Exception):
    """The engine's code does not read this (the message says why, from its source): a note, not a FAIL."""


class Checks:
    def __init__(self, engine: str):
        self.engine = engine  # the prefix of every line, e.g. "vllm"
        self.failed: list[str] = []

    def __call__(self, name: str, fn: Callable[[], object]) -> object:
        try:
            detail = fn()
        except Note as note:
            print(f"     note: {self.engine}: {name}: {note}", flush=True)
            return None
        except Exception as exc:  # one line per check; the traceback goes to stderr
            self.failed.append(name)
            print(f"FAIL {self.engine}: {name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  flush=True)
            traceback.print_exc(file=sys.stderr)
            return None
        print(f"ok   {self.engine}: {name}{': ' + str(detail) if detail not in (None, '') else ''}", flush=True)
        return detail
