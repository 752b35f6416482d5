"""What every benchmark result records about where it came from: script, git revision, machine.

In a script (benchmarks/ or benchmarks/experiments/):

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # only from benchmarks/experiments/
    from provenance import provenance_of
    doc = {..., **provenance_of(__file__)}          # adds doc["provenance"]
    doc = {..., **provenance_of(__file__, seed=0)}  # extra fields go into the same block

From a shell script, for the files it has the CLI write:

    .venv/bin/python benchmarks/provenance.py benchmarks/cpu_check.sh --out benchmarks/results/cpu_check.provenance.json

Outside a git checkout (a device machine gets a copy of the tree without .git) the revision is
read from $DSPARKCTL_GIT_REVISION when set, else recorded as null.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def _root(script: Path) -> Path:
    """The checkout holding `script`: the nearest parent with .git, else the parent of its benchmarks/ folder."""
    for p in script.parents:
        if (p / ".git").exists():
            return p
    return next((p.parent for p in script.parents if p.name == "benchmarks"), script.parent.parent)


def provenance_of(script: str, **extra: Any) -> dict:
    """{"provenance": {script, command, git_revision, git_dirty, machine, cpu, cpus, torch_threads,
    cpu_capability, gpu, torch, created, **extra}}."""
    import torch

    path = Path(script).resolve()
    root = _root(path)

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rel = str(path.relative_to(root))
    except ValueError:
        rel = str(path)
    head = git("rev-parse", "HEAD")
    revision = head or os.environ.get("DSPARKCTL_GIT_REVISION") or None
    ran_as_script = bool(sys.argv and sys.argv[0]) and Path(sys.argv[0]).resolve() == path
    gpu = None
    try:
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken driver must not cost the result
        gpu = None
    return {"provenance": {
        "script": rel,
        "command": [rel, *sys.argv[1:]] if ran_as_script else None,
        "git_revision": revision,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if head else None,
        "machine": platform.machine(), "cpu": cpu or platform.processor() or None,
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
        "torch": torch.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }}


def main() -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Print (or write) the provenance block of a script's results.")
    ap.add_argument("script", help="the script whose results these are (e.g. benchmarks/cpu_check.sh)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here instead of printing it")
    ap.add_argument("--line", action="store_true", help="one line: `provenance: {...}` (for a text log)")
    args = ap.parse_args()
    doc = provenance_of(args.script)
    text = f"provenance: {json.dumps(doc['provenance'])}\n" if args.line else json.dumps(doc, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
