"""`dev-fixture` (hidden, for developers): a miniature checkpoint with real tensor names and dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsparkctl.app.preflight import Output, check_outputs
from dsparkctl.checkpoint.fixtures import FIXTURE_LAYOUTS, write_fixture
from dsparkctl.errors import UsageError


@dataclass(frozen=True)
class FixtureSpec:
    out_dir: Path  # a new folder
    layout: str = "v4.1-flash"  # one of checkpoint/fixtures.py FIXTURE_LAYOUTS


def run_dev_fixture(spec: FixtureSpec) -> Path:
    """Check the layout and OUT (new or empty), write the fixture, return its folder."""
    if spec.layout not in FIXTURE_LAYOUTS:
        raise UsageError(f"no fixture for {spec.layout!r}", hint=f"choose one of {', '.join(FIXTURE_LAYOUTS)}")
    out = spec.out_dir
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise UsageError(f"{out} already exists", hint="choose a new output folder or delete the old one")
    check_outputs([Output(out, "OUT", "folder")])
    return write_fixture(out, spec.layout)
