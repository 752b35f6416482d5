"""File modes: what we create gets the mode a plain open/mkdir would have under the umask."""

from __future__ import annotations

import os


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a temp file/folder (created 0600/0700) the mode a plain open/mkdir would have."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def seal_dir(folder: str | os.PathLike) -> None:
    """Before a written folder takes its final name: every entry gets the umask's mode (some
    writers, safetensors among them, create files 0600 whatever the umask) and every file is
    flushed to disk."""
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            honour_umask(os.path.join(root, name), directory=True)
        for name in files:
            honour_umask(os.path.join(root, name))
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
