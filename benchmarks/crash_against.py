"""The kill points of tests/test_crash_consistency.py run against another checkout's code (issue 28:
"wrong before"), without the recovery that checkout lacks: after each kill, the next run of the
command is the only cleanup, as a user would have it.

For calibrate (JSON + SGLang STS + 5 PNGs) and a draft folder swap, each kill point is judged
wrong when the outputs are a mix of old and new, when calibrate's JSON and STS disagree, when no
whole draft is left, when the rerun fails, or when hidden copies are left after the rerun.

    python benchmarks/crash_against.py --base /tmp/i28-base --work /tmp/crash-old \\
        > benchmarks/results/crash_old.txt
(`git worktree add --detach /tmp/i28-base 191c2e3` makes the checkout.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from tests.test_crash_consistency import KILLER, _points  # noqa: E402 - the very harness the test uses

SWAP = '''
import sys
from dsparkctl.models.draft_io import random_draft, save_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import tiny_target
adapter = TargetAdapter(tiny_target("llama", vocab=64, layers=4))
save_draft(random_draft(adapter, seed=int(sys.argv[1]), num_layers=1, block_size=4), "draft", overwrite=True,
           extra_config={"which": sys.argv[1], "dsparkctl": {"tool": "dsparkctl"}})
'''


def run(base: Path, work: Path, k: int, *argv: str) -> tuple[int, int, str]:
    log = work / "calls.txt"
    log.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{base}{os.pathsep}{HERE}",
           "DSPARKCTL_STATE": str(work / "state")}
    p = subprocess.run([sys.executable, "-c", KILLER, str(k), str(log), *argv], cwd=work, env=env,
                       capture_output=True, text=True)
    return p.returncode, int(log.read_text()) if log.exists() else -1, p.stderr


def hidden(*folders: Path) -> list[str]:
    return [p.name for f in folders if f.exists() for p in f.iterdir() if p.name.startswith(".")]


def calibrate(base: Path, work: Path) -> tuple[int, int]:
    from dsparkctl.formats.trace import write_synthetic_trace
    from dsparkctl.math.synthetic import SyntheticModel

    for name, seed in (("a", 1), ("b", 2)):
        write_synthetic_trace(work / f"{name}.jsonl", SyntheticModel(), 40, 10, seed=seed)
    out = work / "out"
    files = [out / "calib.json", out / "calib.sglang-sts.json",
             *[out / "calib_reliability" / f"reliability_pos{k}.png" for k in range(1, 6)]]
    temps = {}
    for name in ("a", "b"):
        rc, total, err = run(base, work, 0, "calibrate", f"{name}.jsonl", "--out", "out/calib.json")
        assert rc == 0, err
        temps[name] = json.loads(files[0].read_text())["temperatures"]
    points = sorted(random.Random(0).sample(range(1, total - 21), 6)) + list(range(total - 21, total + 1))
    wrong, cur = 0, "b"
    for k in points:
        before = {f: f.read_bytes() if f.exists() else None for f in files}
        rc, _, _ = run(base, work, k, "calibrate", f"{'a' if cur == 'b' else 'b'}.jsonl", "--out", "out/calib.json")
        changed = [f for f in files if (f.read_bytes() if f.exists() else None) != before[f]]
        why = [f"{len(changed)} of {len(files)} outputs changed"] if changed not in ([], files) else []
        try:
            doc, sts = json.loads(files[0].read_text()), json.loads(files[1].read_text())
            why += ["JSON and STS disagree"] if doc["temperatures"] != sts["temperatures"] else []
            cur = next(n for n, t in temps.items() if t == doc["temperatures"])
        except (ValueError, OSError, StopIteration) as exc:
            why.append(f"unreadable: {exc}")
        rc2, _, err2 = run(base, work, 0, "calibrate", f"{cur}.jsonl", "--out", "out/calib.json")
        why += [f"rerun failed: {err2.strip()[-120:]}"] if rc2 else []
        left = hidden(out, out / "calib_reliability")
        why += [f"hidden leftovers after a rerun: {left[:3]}"] if left else []
        wrong += bool(why)
        print("calibrate", k, rc, why, flush=True)
    return len(points), wrong


def swap(base: Path, work: Path) -> tuple[int, int]:
    def which() -> str | None:
        try:
            return json.loads((work / "draft" / "config.json").read_text())["which"]
        except (OSError, ValueError, KeyError):
            return None

    for seed in ("1", "2"):
        rc, total, err = run(base, work, 0, "-c", SWAP, seed)
        assert rc == 0, err
    points, wrong = _points(total, max(1, total - 14), seed=1), 0
    for k in points:
        before = which()
        nxt = "1" if before == "2" else "2"
        rc, _, _ = run(base, work, k, "-c", SWAP, nxt)
        why = [f"no whole draft (config says {which()})"] if which() not in (before, nxt) else []
        rc2, _, err2 = run(base, work, 0, "-c", SWAP, which() or "1")
        why += [f"rerun failed: {err2.strip()[-120:]}"] if rc2 else []
        left = hidden(work)
        why += [f"hidden leftovers after a rerun: {left[:3]}"] if left else []
        wrong += bool(why)
        print("swap", k, rc, why, flush=True)
    return len(points), wrong


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the checkout whose code is killed")
    ap.add_argument("--work", type=Path, required=True, help="a new folder for the runs")
    a = ap.parse_args()
    if not (a.base / "dsparkctl" / "__init__.py").is_file():
        sys.exit(f"error: {a.base} holds no dsparkctl checkout (fix: `git worktree add --detach DIR 191c2e3`)")
    if a.work.exists():
        sys.exit(f"error: {a.work} exists (fix: give a new folder)")
    summary = {}
    for name, fn in (("calibrate", calibrate), ("draft swap", swap)):
        (a.work / name.replace(" ", "_")).mkdir(parents=True)
        tries, wrong = fn(a.base.resolve(), a.work / name.replace(" ", "_"))
        summary[name] = {"tries": tries, "wrong": wrong}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
