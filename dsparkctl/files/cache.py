"""Where caches live: `$DSPARKCTL_CACHE` or `~/.cache/dsparkctl`, each cache overridable by its own variable."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The one folder of every cache dsparkctl keeps (the embedded target's conversion, training
    data and runs, kernel choices, step costs, continuations): `$DSPARKCTL_CACHE`, else
    `$XDG_CACHE_HOME/dsparkctl`, else ~/.cache/dsparkctl. An empty variable counts as unset
    (never the current folder)."""
    return env_path("DSPARKCTL_CACHE") or (env_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsparkctl"


def cache_location(name: str, override: str) -> Path:
    """One cache's place: `$<override>` when set, else `cache_root() / name`."""
    return env_path(override) or cache_root() / name


def env_path(name: str) -> Path | None:
    """The path an environment variable names, or None when it is unset or empty (or blank)."""
    value = os.environ.get(name, "")
    return Path(value).expanduser() if value.strip() else None
