"""May we replace this path? Only what this command wrote there, as its folder's ledger records
(`files.ledger`); never a link, a device, a folder where a file goes, or anything unrecorded.
`written_by_us` / `json_is_ours` say whether a file carries our marks: a hint for readers and
messages, never a licence to replace."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable

from dsparkctl.files import ledger
from dsparkctl.strict_json import loads

# ------------------------------------------------------------------ may we replace this path?
MARK = "dsparkctl"


# files we write in other tools' formats, which carry no marker of ours: recognised by their exact keys
FOREIGN_SCHEMAS = (frozenset({"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}),  # SGLang SPS
                   frozenset({"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}))  # SGLang STS


_SNIFF = 64 * 1024


_WHOLE_JSON = 64 * 1024 * 1024


def json_is_ours(obj: Any) -> bool:
    """A JSON document we wrote: an object whose `format` is one of ours ("dsparkctl-..."), or that
    carries our provenance (`provenance` / `dsparkctl` with tool "dsparkctl"), or a file of another
    tool's format that we write (FOREIGN_SCHEMAS, by its exact keys)."""
    if not isinstance(obj, dict):
        return False
    fmt = obj.get("format")
    if isinstance(fmt, str) and fmt.startswith(MARK + "-"):
        return True
    for key in ("provenance", MARK):
        block = obj.get(key)
        if isinstance(block, dict) and block.get("tool") == MARK:
            return True
    return frozenset(obj) in FOREIGN_SCHEMAS


def written_by_us(path: str | os.PathLike) -> bool:
    """Whether a regular file carries our own marker. JSON (and JSON lines): see `json_is_ours`,
    on the first line or the whole document; anything else (figures, scripts): the bytes
    "dsparkctl" in its first or last 64 KiB (PNG text chunk, PDF/SVG creator, script header)."""

    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF)
            fh.seek(max(0, size - _SNIFF))
            tail = fh.read(_SNIFF)
            if head.lstrip()[:1] == b"{":
                first = head.split(b"\n", 1)[0]
                try:
                    if json_is_ours(loads(first.decode("utf-8"))):
                        return True
                except (ValueError, RecursionError):
                    pass
                if size > _WHOLE_JSON:
                    return False
                fh.seek(0)
                return json_is_ours(loads(fh.read().decode("utf-8")))
    except (OSError, ValueError, RecursionError):
        return False
    return MARK.encode() in head or MARK.encode() in tail


def replace_refusal(path: str | os.PathLike, ours: Callable[[Path], bool] | None = None,
                   as_folder: bool = False) -> str | None:
    """The one rule for every output where a user may have put something: None (may write) when
    nothing is at `path`, or when it is a regular file (a folder, with `as_folder`), not a link,
    that this very command wrote there (`files.ledger`: what we recorded, never what it looks
    like; `ours` overrides the rule for a cache of our own); otherwise why not, as words to follow
    the path ("is a symbolic link", "was written by `dsparkctl train`, not by this command", ...)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (`cannot_create` says why it cannot be)
        return None
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if stat.S_ISDIR(st.st_mode) != as_folder:
        return "is a folder" if stat.S_ISDIR(st.st_mode) else "is not a folder"
    if not as_folder and not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a FIFO, socket or device)"
    if ours is not None:
        return None if ours(Path(path)) else f"exists and was not written by {MARK}"
    writer = ledger.writer_of(path)
    if writer is None:
        return f"exists and {MARK} has no record of writing it there"
    if writer != ledger.command():
        return f"was written by `{MARK} {writer}`, not by this command"
    return None


def regular_file(path: str | os.PathLike) -> bool:
    """True for a regular file (not a link to one, not a FIFO or device): the only thing a cache
    reader may open (a FIFO would block it, a device stream into it)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
