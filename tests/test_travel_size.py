"""The device tool's 64 MiB limit on what travels: benchmarks/travel_size.py counts it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from travel_size import total_mib, travelling_files  # noqa: E402


def test_counts_tracked_untracked_and_carried_but_not_ignored(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "a.bin").write_bytes(b"x" * 2 ** 20)  # untracked, not ignored: travels
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"x" * 3 * 2 ** 20)  # ignored: stays unless carried
    files = travelling_files(repo, [])
    assert {f.name for f in files} == {".gitignore", "a.bin"}
    assert 1.0 <= total_mib(files) < 1.01
    carried = travelling_files(repo, [Path("ignored")])
    assert 4.0 <= total_mib(carried) < 4.01


def test_the_script_fails_over_the_limit(tmp_path):
    big = tmp_path / "wheels"
    big.mkdir()
    (big / "w.whl").write_bytes(b"\0" * (65 * 2 ** 20))
    script = str(ROOT / "benchmarks" / "travel_size.py")
    res = subprocess.run([sys.executable, script, "--carry", str(big)], capture_output=True, text=True)
    assert res.returncode == 1 and "over the limit" in res.stderr
    ok = subprocess.run([sys.executable, script, "--carry", str(big), "--limit-mib", "200"], capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
