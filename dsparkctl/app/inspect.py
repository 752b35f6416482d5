"""`inspect`: open a checkpoint (a hub repo by its headers only) and report its layout and findings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsparkctl.checkpoint.hub import open_checkpoint
from dsparkctl.checkpoint.inspect import inspect_report


@dataclass(frozen=True)
class InspectSpec:
    """What `inspect` reads: a local checkpoint folder or a hub repo id (at `revision`)."""
    source: str
    revision: str | None = None


def run_inspect(spec: InspectSpec) -> dict[str, Any]:
    """`inspect` as one call: open the checkpoint (a hub repo by its headers only) and report it
    (`inspect_report`), with the bytes read over the network when any were."""

    ckpt = open_checkpoint(spec.source, spec.revision)
    report = inspect_report(ckpt)
    if ckpt.bytes_transferred:
        report["transferred_bytes"] = ckpt.bytes_transferred
    return report
