"""What every written file says about itself."""

from __future__ import annotations

import datetime as _dt
import platform
from typing import Any

from dsparkctl import __version__


def provenance(**inputs: Any) -> dict[str, Any]:
    """A provenance block: tool version, time, host python, plus caller-supplied inputs."""
    return {
        "tool": "dsparkctl",
        "tool_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        **{k: v for k, v in inputs.items() if v is not None},
    }
