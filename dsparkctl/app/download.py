"""`download`: check the repo id and the folder (new, empty, or one a download used), fetch only the
draft's files (checkpoint/hub.py) and report what was fetched and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsparkctl.app.preflight import Output, check_outputs
from dsparkctl.checkpoint.hub import check_repo_id, download
from dsparkctl.errors import UsageError, option


@dataclass(frozen=True)
class DownloadSpec:
    """Everything `download` runs (`run_download` checks it)."""
    repo: str  # hub repo id (org/name)
    revision: str | None = None
    local_dir: Path | None = None  # None: the hub cache
    with_head: bool = False  # also the target's embed/head the draft borrows


def run_download(spec: DownloadSpec, *, on_file: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """`download` as one call: check the repo id and the folder, fetch the draft's files
    (`download`; `on_file(file, bytes)` before each), return {"folder", "revision", "fetched",
    "skipped"} (each file as {"file", "bytes"})."""

    check_repo_id(spec.repo)
    local_dir = spec.local_dir
    if local_dir is not None:
        check_outputs([Output(local_dir, option("local_dir"), "folder", whole=False)])
        if local_dir.is_symlink() or (local_dir.is_dir() and any(local_dir.iterdir())
                                      and not (local_dir / ".cache" / "huggingface").is_dir()):
            raise UsageError(f"{option('local_dir')} {local_dir} holds files that no download wrote; the download "
                             "would replace them",
                             hint="download into a new or empty folder (or the one a download used)")
    res = download(spec.repo, spec.revision, local_dir, spec.with_head, on_file=on_file)
    return {"folder": str(res.folder), "revision": res.revision,
            "fetched": [{"file": f, "bytes": b} for f, b in res.fetched],
            "skipped": [{"file": f, "bytes": b} for f, b in res.skipped]}
