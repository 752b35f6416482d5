"""What a device call sends, in MiB: tracked and untracked-not-ignored files plus carried paths.

The device tool refuses more than 64 MiB (device README, Limits). Exit status 1 when over.

    python benchmarks/travel_size.py [--carry PATH ...] [--limit-mib 64]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LIMIT_MIB = 64


def travelling_files(repo: Path, carry: list[Path]) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                         check=True).stdout.decode()
    files = [repo / f for f in out.split("\0") if f]
    for c in carry:
        c = c if c.is_absolute() else repo / c
        files += [p for p in c.rglob("*") if p.is_file()] if c.is_dir() else ([c] if c.is_file() else [])
    return [f for f in files if f.is_file()]


def total_mib(files: list[Path]) -> float:
    return sum(f.stat().st_size for f in files) / 2 ** 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carry", action="append", default=[], type=Path)
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    args = ap.parse_args()
    repo = Path(__file__).resolve().parents[1]
    files = travelling_files(repo, args.carry)
    mib = total_mib(files)
    biggest = sorted(files, key=lambda f: f.stat().st_size, reverse=True)[:3]
    print(f"travels: {mib:.1f} MiB in {len(files)} files (limit {args.limit_mib:.0f} MiB); largest: "
          + ", ".join(f"{f.relative_to(repo) if f.is_relative_to(repo) else f} {f.stat().st_size / 2 ** 20:.1f} MiB"
                      for f in biggest))
    if mib > args.limit_mib:
        print("over the limit: ignore or carry less", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
