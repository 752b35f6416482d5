"""Benchmark `extract` on a synthetic >= 1 GB V4.1-layout checkpoint against `cp` of the same shards.

Builds the checkpoint in a temp folder on /tmp (deleted afterwards), then, in the same run and
interleaved, times: `extract` (library call in a child process, as the CLI runs it, fsync
included) and `cp` of the draft shard files (plain, and followed by fsync for a like-for-like
figure). Medians over --repeats. Peak RSS of each extract child comes from os.wait4's rusage.
Targets (issue 3): throughput ratio cp_time / extract_time >= 0.5; peak RSS <= largest tensor + 300 MB.

    .venv/bin/python benchmarks/bench_extract.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance_of  # benchmarks/provenance.py

from dsparkctl.checkpoint.source import open_local
from dsparkctl.files.atomic import write_json

EXTRACT = ("import sys; from pathlib import Path; from dsparkctl.checkpoint.source import open_local; "
           "from dsparkctl.checkpoint.extract import extract; "
           "extract(open_local(Path(sys.argv[1])), Path(sys.argv[2]), dequantize=sys.argv[3] == 'bf16'); "
           # VmHWM is this process's own peak RSS (reset by exec, unlike ru_maxrss, which inherits
           # the forking parent's peak)
           "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0], file=sys.stderr)")


CPU: list[float] = []  # CPU seconds (user + system) of the last child run_child ran


def run_child(args: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process; its CPU seconds go to CPU[-1]."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    if proc.returncode:
        raise SystemExit(f"child failed ({proc.returncode}): {' '.join(args)}\n{stderr}")
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    return wall, int(last) * 1024 if last.isdigit() else 0  # VmHWM is in KiB


def fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)  # the folder's entries too, as extract does
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def psi() -> float | None:
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[2].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def remove(folder: Path) -> None:
    """Delete a step's output, then sync, untimed: on a filesystem mounted with `discard` (this
    one: ext4 rw,discard) deleting fsynced blocks queues TRIMs that the next journal commit waits
    for, which otherwise lands on whichever step runs next (measured: cp 0.9 s -> 6 s after an
    extract whose output had just been deleted)."""
    shutil.rmtree(folder)
    os.sync()


def warm(files: list[Path]) -> None:
    """fsync (no writeback left for a timed step to pay) and read once (page cache warm for all)."""
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            os.fsync(fh.fileno())
            buf = bytearray(8 << 20)
            while fh.readinto(buf):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "extract.json")
    ap.add_argument("--dequantize", action="store_true", help="also time --dequantize bf16 once")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dspark-bench-", dir="/tmp"))
    try:
        t0 = time.perf_counter()
        # build in a child so this process stays small
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from dsparkctl.checkpoint.fixtures import bench_dims, write_fixture; "
                        "write_fixture(Path(sys.argv[1]), 'v4.1-flash', bench_dims(), seed=1)", str(work / "src")],
                       check=True)
        src = work / "src"
        build_s = time.perf_counter() - t0
        ckpt = open_local(src)
        names = ckpt.draft_names()
        shards = sorted({ckpt.weight_map[n] for n in names})
        shard_bytes = sum((src / f).stat().st_size for f in shards)
        largest = max(ckpt.tensor(n).nbytes for n in names)
        print(f"checkpoint: {ckpt.total_size / 1e9:.2f} GB in {len(ckpt.headers)} shards "
              f"(built in {build_s:.1f} s); draft: {len(names)} tensors in {len(shards)} shards, "
              f"{shard_bytes / 1e9:.2f} GB; largest draft tensor {largest / 1e6:.1f} MB", file=sys.stderr)

        warm([src / f for f in sorted(ckpt.headers)])
        shard_paths = [str(src / f) for f in shards]

        def step_extract(i: int) -> None:
            out = work / f"out{i}"
            wall, rss = run_child([sys.executable, "-c", EXTRACT, str(src), str(out), "none"])
            ext_t.append(wall)
            ext_rss.append(rss)
            ext_cpu.append(CPU[-1])
            remove(out)

        def step_cp(i: int) -> None:
            dst = work / f"cp{i}"
            dst.mkdir()
            cp_t.append(run_child(["cp", *shard_paths, str(dst)])[0])
            cp_cpu.append(CPU[-1])
            remove(dst)

        def step_cp_fsync(i: int) -> None:
            dst = work / f"cps{i}"
            dst.mkdir()
            t = time.perf_counter()
            run_child(["cp", *shard_paths, str(dst)])
            fsync_tree(dst)
            cps_t.append(time.perf_counter() - t)
            remove(dst)

        ext_t, ext_rss, cp_t, cps_t, start_t, ext_cpu, cp_cpu = [], [], [], [], [], [], []
        steps = [step_extract, step_cp, step_cp_fsync]
        for i in range(args.repeats):
            for k in range(3):
                steps[(i + k) % 3](i)
            start_t.append(run_child([sys.executable, "-c", "import dsparkctl.checkpoint.extract"])[0])
            print(f"repeat {i}: extract {ext_t[-1]:.2f} s (peak RSS {ext_rss[-1] / 1e6:.0f} MB), cp {cp_t[-1]:.2f} s, "
                  f"cp+fsync {cps_t[-1]:.2f} s, ratio {cp_t[-1] / ext_t[-1]:.2f}; CPU s extract {ext_cpu[-1]:.2f} "
                  f"cp {cp_cpu[-1]:.2f}", file=sys.stderr)

        deq = None
        if args.dequantize:
            out = work / "deq"
            wall, rss = run_child([sys.executable, "-c", EXTRACT, str(src), str(out), "bf16"])
            deq = {"seconds": round(wall, 3), "peak_rss_bytes": rss,
                   "output_bytes": sum(p.stat().st_size for p in out.iterdir())}
            shutil.rmtree(out)

        med = {k: statistics.median(v) for k, v in
               {"extract": ext_t, "cp": cp_t, "cp_fsync": cps_t}.items()}
        result = {
            "checkpoint_bytes": ckpt.total_size,
            "draft_shard_bytes": shard_bytes,
            "draft_tensors": len(names),
            "largest_tensor_bytes": largest,
            "repeats": args.repeats,
            "median_seconds": {k: round(v, 3) for k, v in med.items()},
            "extract_GBps": round(shard_bytes / med["extract"] / 1e9, 3),
            "cp_GBps": round(shard_bytes / med["cp"] / 1e9, 3),
            "ratio_vs_cp": round(med["cp"] / med["extract"], 3),
            "ratio_vs_cp_fsync": round(med["cp_fsync"] / med["extract"], 3),
            "per_repeat_seconds": {"extract": [round(t, 3) for t in ext_t], "cp": [round(t, 3) for t in cp_t],
                                   "cp_fsync": [round(t, 3) for t in cps_t]},
            "per_repeat_ratio_vs_cp": [round(c / e, 3) for c, e in zip(cp_t, ext_t)],
            # paired statistic: each repeat's extract and cp ran back to back under the same load
            "median_of_per_repeat_ratios_vs_cp": round(statistics.median(c / e for c, e in zip(cp_t, ext_t)), 3),
            "python_startup_s": round(statistics.median(start_t), 3),
            # load-independent: what each step costs in CPU time (user + system, median)
            "median_cpu_seconds": {"extract": round(statistics.median(ext_cpu), 3),
                                   "cp": round(statistics.median(cp_cpu), 3)},
            # how contended the shared machine was during the run (PSI; None where unavailable)
            "cpu_pressure_some_avg60": psi(),
            "order": "steps rotate per repeat: extract/cp/cp+fsync, cp/cp+fsync/extract, ...",
            "page_cache": "source fsynced and read once before timing; warm for every step",
            "ratio_target": 0.5,
            "peak_rss_bytes": max(ext_rss),
            "rss_budget_bytes": largest + 300_000_000,
            "rss_within_budget": max(ext_rss) <= largest + 300_000_000,
            "children_max_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "dequantize_bf16": deq,
            "cpus": os.cpu_count(),
            **provenance_of(__file__),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.out, result)
    print(f"extract {result['extract_GBps']} GB/s vs cp {result['cp_GBps']} GB/s: ratio {result['ratio_vs_cp']} "
          f"(vs cp+fsync {result['ratio_vs_cp_fsync']}; target >= 0.5)")
    print(f"median of per-repeat ratios vs cp: {result['median_of_per_repeat_ratios_vs_cp']}")
    print(f"CPU seconds: extract {result['median_cpu_seconds']['extract']} vs cp {result['median_cpu_seconds']['cp']}; "
          f"CPU pressure (some, avg60) {result['cpu_pressure_some_avg60']}%")
    print(f"peak RSS {result['peak_rss_bytes'] / 1e6:.0f} MB vs budget largest tensor + 300 MB = "
          f"{result['rss_budget_bytes'] / 1e6:.0f} MB: {'OK' if result['rss_within_budget'] else 'OVER'}")
    if deq:
        print(f"--dequantize bf16: {deq['seconds']} s, peak RSS {deq['peak_rss_bytes'] / 1e6:.0f} MB")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
