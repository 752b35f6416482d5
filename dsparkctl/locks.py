"""Lock files whose owner is known for sure, and waits that end.

A lock names its owner by more than a pid: pid, the process's start time (clock ticks since
boot, /proc/<pid>/stat), the boot id and the host. After a crash or a reboot the pid may belong
to an unrelated live process; with the start time and boot id that process is not mistaken for
the owner, so the lock is stale. A lock of another host (a shared file system) cannot be checked:
it is waited for, with a message, for a bounded time, and then refused in one line that says
which process to look for and which file to delete.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsparkctl.checks import ascii_float
from dsparkctl.errors import InputError, UsageError
from dsparkctl.files.ownership import regular_file
from dsparkctl.strict_json import loads


WAIT_ENV = "DSPARKCTL_LOCK_WAIT_S"
DEFAULT_WAIT_S = 1800.0


def wait_limit() -> float:
    """`$DSPARKCTL_LOCK_WAIT_S` (seconds, a finite number >= 0), else 30 min: at most this long behind
    one lock. A value that is not such a number is refused, not read as the default."""
    text = os.environ.get(WAIT_ENV)
    if text is None or not text.strip():
        return DEFAULT_WAIT_S
    value = ascii_float(text.strip())
    if value is None or value < 0:
        raise UsageError(f"{WAIT_ENV}={text!r} is not a number of seconds >= 0",
                         f"set it to seconds, e.g. {WAIT_ENV}=600, or unset it for the default of 30 min")
    return value


def duration(seconds: float) -> str:
    """A wait as people say it: "0.3 s", "45 s" below a minute, else "12 min"."""
    return f"{seconds:.1f} s" if seconds < 9.95 else f"{seconds:.0f} s" if seconds < 59.5 else f"{seconds / 60:.0f} min"


def _start_ticks(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), or None (no such process / no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after "(comm)"
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_alive(pid: object, start: object = None) -> bool:
    """Whether process `pid` runs on this host. With `start` (its start time, as `me()` records
    it) only that very process counts, not a later one that was given the same pid. A pid that
    is not a positive int (a damaged file) is no process; one we may not signal runs."""
    if type(pid) is not int or pid <= 0:
        return False
    if start is not None:
        ticks = _start_ticks(pid)
        return ticks is not None and ticks == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def me() -> dict:
    """This process as a lock owner."""
    return {"pid": os.getpid(), "start": _start_ticks(os.getpid()), "boot": _boot_id(), "host": socket.gethostname()}


@dataclass(frozen=True)
class Holder:
    owner: dict | None  # None: unreadable or of an older format (a bare pid)
    alive: bool | None  # None: cannot tell (another host)

    def describe(self) -> str:
        if not self.owner:
            return "an unknown process"
        return f"process {self.owner.get('pid')} on {self.owner.get('host')}"


def holder(lock: Path) -> Holder:
    """Who holds `lock`, and whether that process still runs (the same pid, start time and boot)."""

    if not regular_file(lock):  # a FIFO would block the read: not a lock of ours, stale
        return Holder(None, False)
    try:
        owner = loads(lock.read_bytes())
    except (OSError, ValueError, RecursionError):
        return Holder(None, False)
    if not isinstance(owner, dict) or type(owner.get("pid")) is not int or not isinstance(owner.get("host"), str):
        return Holder(None, False)  # a bare pid (older versions) or damage: cannot be trusted, stale
    if owner["host"] != socket.gethostname():
        return Holder(owner, None)
    if owner.get("boot") != _boot_id():
        return Holder(owner, False)  # written before a reboot
    # a lock written without a start time (no /proc) cannot name its process for sure: stale
    return Holder(owner, owner.get("start") is not None and pid_alive(owner["pid"], owner["start"]))


def check_lock_path(lock: Path) -> None:
    """Refuse a lock path that holds a folder: no process of ours made it, and it can be neither
    created nor removed as a lock file."""
    if lock.is_dir() and not lock.is_symlink():
        raise InputError(f"the lock file {lock} is a folder", f"remove or rename the folder {lock} (dsparkctl "
                         "creates its lock file there)")


def claim(lock: Path) -> bool:
    """Create `lock` naming this process, only if it does not exist (O_EXCL); False when it does."""
    check_lock_path(lock)
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump(me(), fh)
    return True


def release(lock: Path) -> None:
    """Remove `lock` if it is still ours."""
    h = holder(lock)
    if h.owner and h.owner.get("pid") == os.getpid() and h.owner.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()


def wait_for(lock: Path, done: Callable[[], bool], what: str, log: Callable[[str], None] = print,
             poll: float = 2.0, limit_s: float | None = None) -> None:
    """Return once `done()` or `lock` is gone or stale (a stale lock is removed, with a note). A
    live holder is waited for with a message, for at most `limit_s` (`wait_limit()`), then refused."""
    check_lock_path(lock)
    limit = wait_limit() if limit_s is None else limit_s
    t0 = time.monotonic()
    said = False
    while os.path.lexists(lock) and not done():
        h = holder(lock)
        if h.owner and h.owner.get("pid") == os.getpid() and h.owner.get("host") == socket.gethostname():
            lock.unlink(missing_ok=True)  # our own, left by an earlier attempt in this process
            return
        if h.alive is False:
            log(f"note: removed the stale lock {lock} ({h.describe()} no longer runs)")
            lock.unlink(missing_ok=True)
            return
        waited = time.monotonic() - t0
        if waited >= limit:
            raise InputError(f"{what} has been locked by {h.describe()} for {duration(waited)} ({lock})",
                             f"if that process no longer runs, delete {lock}")
        if not said:
            log(f"waiting for {h.describe()}, which is building {what} (lock {lock}; at most "
                f"{duration(limit)})")
            said = True
        time.sleep(poll)


def refuse_if_held(lock: Path, what: str) -> None:
    """Claim `lock` for `what` (e.g. a run folder) or refuse at once, in one line, when a live
    process holds it; a stale lock is taken over."""
    for _ in range(2):
        if claim(lock):
            return
        h = holder(lock)
        if h.alive is False or (h.owner and h.owner.get("pid") == os.getpid()):
            lock.unlink(missing_ok=True)
            continue
        raise InputError(f"{what} is in use by {h.describe()} ({lock})",
                         f"wait for it to finish; if it no longer runs, delete {lock}")
    raise InputError(f"{what}: cannot take the lock {lock}", f"delete {lock} if no dsparkctl process uses it")
