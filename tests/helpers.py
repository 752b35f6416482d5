"""Small helpers shared by the test tables."""

from __future__ import annotations

import os
from pathlib import Path


def snapshot(*roots: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `roots` with its mode, size and mtime (lstat: never follows a link or opens a FIFO),
    so a test can assert that a refused command left, created and changed nothing."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                out[p] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out
