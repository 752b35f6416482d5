"""How calibrate / sweep-scheduler / audit grow with the trace: wall time and peak RSS (issue 28).

Builds synthetic traces of about `--sizes` bytes (default 10 MB and 1 GB) in `--work` (default a
temporary folder, removed afterwards), runs each command as a subprocess under `/usr/bin/time`
with OMP_NUM_THREADS=1, and records wall seconds and peak RSS. `--base DIR` also runs the same
commands with another checkout's code (e.g. the commit before the streamed readers) on
`--base-sizes` (default 10 MB and 100 MB: the object reader needs ~2 KB a round, too much for a
shared machine at 1 GB). `audit` reads no trace: it simulates as many request-rounds as the trace
holds (two policies, Appendix A with and without a plain-step price), so its row says how a
simulation of that size grows. One run per command on a terminal (a pty) checks that the
progress bar shows.

    python benchmarks/bench_trace_scale.py --base /tmp/i28-base \\
        --out benchmarks/results/trace_scale.json --md benchmarks/results/trace_scale.md
"""

from __future__ import annotations

import argparse
import os
import pty
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from dsparkctl.files.atomic import write_json  # noqa: E402
from dsparkctl.formats.trace import write_synthetic_trace  # noqa: E402
from dsparkctl.math.synthetic import SyntheticModel  # noqa: E402

SPS = '{"format": "dsparkctl-sps/1", "batch_tokens": [1, 4, 16, 64, 256, 1024, 8192], ' \
      '"steps_per_sec": [50.0, 40.0, 35.0, 25.0, 12.0, 4.0, 0.6]}'
BYTES_PER_ROUND = 235  # a synthetic round of block size 5 with confidences


def parse_size(text: str) -> int:
    units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}
    return int(float(text[:-2]) * units[text[-2:].upper()]) if text[-2:].upper() in units else int(text)


def build(work: Path, label: str, size: int) -> tuple[Path, int]:
    path = work / f"trace_{label}.jsonl"
    requests = max(10, size // BYTES_PER_ROUND // 50)
    t = time.perf_counter()
    n = write_synthetic_trace(path, SyntheticModel(), requests, 50, seed=1,
                              extra_header={"target": "bench", "draft": "bench", "dataset": "bench"})
    print(f"built {path.name}: {n:,} rounds, {path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t:.0f} s",
          flush=True)
    return path, n


def commands(trace: Path, rounds: int, work: Path) -> dict[str, list[str]]:
    return {"calibrate": ["calibrate", str(trace), "--out", str(work / "out" / "c.json"), "--json"],
            "sweep-scheduler": ["sweep-scheduler", "--trace", str(trace), "--sps-table", str(work / "sps.json"),
                                "--json"],
            "audit": ["audit", "--policies", "static:2,dspark", "--random-settings", "0",
                      "--rounds", str(rounds), "--plain-rounds", str(rounds), "--json"]}


def measure(code: Path, argv: list[str], work: Path) -> dict:
    shutil.rmtree(work / "out", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    timing = work / "time.txt"
    r = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", str(timing), sys.executable, "-m", "dsparkctl", *argv],
                       env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall, rss_kb = timing.read_text().split()[-2:]
    return {"exit": r.returncode, "wall_s": float(wall), "peak_rss_mb": round(int(rss_kb) / 1024, 1),
            "error": r.stderr.strip().splitlines()[-1] if r.returncode not in (0, 1) and r.stderr.strip() else None}


def bar_on_a_terminal(code: Path, argv: list[str], work: Path) -> bool:
    """Run once with stderr on a pty: does a progress bar ("reading traces" / "audit") appear?"""
    shutil.rmtree(work / "out", ignore_errors=True)
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    p = subprocess.Popen([sys.executable, "-m", "dsparkctl", *argv], env=env, cwd=work, stdout=subprocess.DEVNULL,
                         stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    p.wait()
    os.close(master)
    return b"reading traces" in seen or b"audit" in seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="folder for the traces (default: a temporary one)")
    ap.add_argument("--sizes", default="10MB,1GB")
    ap.add_argument("--base", type=Path, default=None, help="another checkout to measure (the code before)")
    ap.add_argument("--base-sizes", default="10MB,100MB")
    ap.add_argument("--out", type=Path, default=HERE / "benchmarks/results/trace_scale.json")
    ap.add_argument("--md", type=Path, default=HERE / "benchmarks/results/trace_scale.md")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="trace_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "sps.json").write_text(SPS)
    sizes = args.sizes.split(",")
    base_sizes = args.base_sizes.split(",") if args.base else []
    rows = []
    try:
        for label in dict.fromkeys(sizes + base_sizes):
            trace, n = build(work, label, parse_size(label))
            runs = [("after", HERE)] * (label in sizes) + [("before", args.base)] * (label in base_sizes)
            for which, code in runs:
                for name, argv in commands(trace, n, work).items():
                    m = measure(code, argv, work)
                    rows.append({"code": which, "command": name, "trace": label,
                                 "trace_mb": round(trace.stat().st_size / 1e6, 1), "rounds": n, **m})
                    print(rows[-1], flush=True)
            trace.unlink()  # the disk is shared: one size at a time
        small = next((s for s in sizes), None)
        bars = {}
        if small:
            trace, n = build(work, small, parse_size(small))
            bars = {name: bar_on_a_terminal(HERE, argv, work) for name, argv in commands(trace, n, work).items()}
            trace.unlink()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    doc = {"what": "wall time and peak RSS of each command on synthetic traces (block size 5, ~235 bytes a round), "
                   "OMP_NUM_THREADS=1, one run each on a shared 2-core machine",
           "python": sys.version.split()[0], "rows": rows, "progress_bar_on_a_terminal": bars}
    write_json(args.out, doc)
    lines = ["| code | command | trace | rounds | wall s | peak RSS MB |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['code']} | {r['command']} | {r['trace']} ({r['trace_mb']} MB) | {r['rounds']:,} | "
              f"{r['wall_s']:.1f} | {r['peak_rss_mb']:.0f} |" for r in rows]
    lines += ["", "Progress bar on a terminal (pty): " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in bars.items())]
    args.md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
