"""What a fresh clone of this repository moves: the packed history a `git clone` transfers, the
commits, the checked-out tree, and the largest files in the history (what makes it heavy).

    python benchmarks/clone_size.py [--out benchmarks/results/clone_size.json]

It clones the current branch from the local repository the way a remote clone would (`--no-local`:
objects are packed and sent, not hard-linked) into a temporary folder, measures, and removes it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import provenance_of  # noqa: E402


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def largest_blobs(repo: Path, n: int = 5) -> list[dict]:
    """The n largest paths in the history, by their largest version, with how many versions exist."""
    objects = git("rev-list", "--objects", "--all", cwd=repo).splitlines()
    paths = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in objects if " " in line}
    sizes = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize)"], cwd=repo, check=True,
        capture_output=True, text=True, input="\n".join(paths)).stdout.splitlines()
    by_path: dict[str, list[int]] = {}
    for line in sizes:
        sha, kind, size = line.split()
        if kind == "blob":
            by_path.setdefault(paths[sha], []).append(int(size))
    top = sorted(by_path.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [{"path": p, "versions": len(v), "bytes_all_versions": sum(v)} for p, v in top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "--quiet", "--no-local", "--single-branch", str(ROOT), str(clone)], check=True)
        pack = folder_bytes(clone / ".git" / "objects")
        tree = folder_bytes(clone) - folder_bytes(clone / ".git")
        doc = {"clone_mib": round(pack / 2 ** 20, 1), "checkout_mib": round(tree / 2 ** 20, 1),
               "commits": int(git("rev-list", "--count", "HEAD", cwd=clone)),
               "largest_in_history": largest_blobs(clone), **provenance_of(__file__)}
    print(f"a fresh clone moves {doc['clone_mib']} MiB of history ({doc['commits']} commits) and checks out "
          f"{doc['checkout_mib']} MiB")
    for b in doc["largest_in_history"]:
        print(f"  {b['bytes_all_versions'] / 2 ** 20:6.1f} MiB  {b['versions']:3d} versions  {b['path']}")
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
