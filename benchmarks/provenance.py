"""What every benchmark result records about where it came from: script, git revision, machine."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path


def provenance_of(script: str) -> dict:
    """{"provenance": {script, git_revision, git_dirty, machine, cpu, threads, torch, created}}."""
    import torch

    root = Path(script).resolve().parent.parent

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
    return {"provenance": {
        "script": str(Path(script).resolve().relative_to(root)),
        "git_revision": git("rev-parse", "HEAD") or None,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": platform.machine(), "cpu": cpu or platform.processor() or None,
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }}
