"""SIGTERM and SIGHUP unwind like SIGINT, so `finally` blocks and atomic writers clean up.

Python turns SIGINT into KeyboardInterrupt, which runs every cleanup on its way out. SIGTERM
(`kill`, systemd, container runtimes) and SIGHUP (a closed terminal) end the process on the spot
by default and leave temporary files behind. Inside `terminate_as_interrupt()` (the CLI wraps a
command in it) all three raise KeyboardInterrupt in the main thread, once: a repeat while the
cleanup runs is ignored, so a second Ctrl-C or a supervisor's repeated TERM cannot cut it short.

Library code wraps a step that must not be cut in two in `deferred()` (a signal inside it is
taken when it ends), and calls `point_of_no_return()` when its result is complete and only the
rename into place is left: from then on signals are ignored until the block ends, because unwinding could no
longer undo the result, only report "nothing was written" beside a finished output.

SIGKILL cannot be handled; see `checkpoint.partials` for what the next run does about it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None),
                            getattr(signal, "SIGHUP", None)) if s is not None)
_state: dict[str, bool] = {"active": False, "ignore": False, "defer": False, "pending": False}


def _importing(frame: Any) -> bool:
    """Whether the interrupted code runs inside an import (a C extension's init may be under it: an
    exception raised there leaves the interpreter in a state it aborts on)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM/SIGHUP raise KeyboardInterrupt once; later ones are ignored."""
    if threading.current_thread() is not threading.main_thread() or _state["active"]:
        yield  # only the main thread may set handlers; an outer block already has them
        return

    def handler(signum: int, frame: Any) -> None:
        if _state["ignore"]:
            return
        if _state["defer"]:  # inside `deferred()`: taken when it ends
            _state["pending"] = True
            return
        if _importing(frame) and hasattr(signal, "setitimer"):  # an interrupted extension init aborts Python
            def again(_s: int, f: Any) -> None:
                signal.signal(signal.SIGALRM, previous_alarm)
                handler(signum, f)
            previous_alarm = signal.signal(signal.SIGALRM, again)
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # taken once the import is over
            return
        _state["ignore"] = True
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    _state.update(active=True, ignore=False)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _state.update(active=False, ignore=False, defer=False, pending=False)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A step that must not be cut in two (renames that put several outputs in place, a folder
    swapped for its new version): a signal inside it takes effect, as KeyboardInterrupt, when the
    block ends normally, so the outputs are all old or all new and the message counts them right."""
    if not _state["active"] or _state["defer"]:
        yield
        return
    _state["defer"] = True
    try:
        yield
    finally:
        _state["defer"] = False
    if _state["pending"] and not _state["ignore"]:
        _state.update(pending=False, ignore=True)
        raise KeyboardInterrupt("a signal during a step that completes")


def point_of_no_return() -> None:
    """The result is complete; signals from now until the block ends are ignored (module doc)."""
    if _state["active"]:
        _state["ignore"] = True
