"""The median of a benchmark's figure over its independent units, with a 95% interval when there
are enough units for one and the plain range, called a range, when there are not.

A unit is what varies independently from one measurement to the next: a prompt in
`bench_speedup.py` (greedy repeats of one prompt decode the same tokens, so they are one unit, not
several), a group of prompts in `bench_policies.py`. Repeats within a unit are aggregated first
(`unit_medians`); the interval is then taken over the units (`over_units`).

The interval is distribution-free: the order statistics x(k+1) and x(n-k) of n unit values cover
the population median with probability 1 - 2·P(Binomial(n, 1/2) <= k), whatever the
distribution. The widest pair, the minimum and the maximum, covers it with 1 - 2/2^n: below 95%
for n <= 5, so with 5 units or fewer there is no 95% interval of this kind, and what is reported
is the range of the units, named as such. (A bootstrap of the median over 3 groups is not a way
out: it can only return values among the 3, in effect their minimum and maximum.)

Pure Python; no dsparkctl import, so tests and scripts import it freely. `rewrite_results` is the
writer of the scripts' `--recompute`: it replaces the very results file it was given, and nothing
else, in the format `dsparkctl.files.atomic.write_json` writes.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Hashable, Iterable
from math import comb
from pathlib import Path

LEVEL = 0.95


def coverage(n: int, k: int) -> float:
    """The probability that [x(k+1), x(n-k)] (1-based order statistics of n values) covers the
    population median: 1 - 2·P(Binomial(n, 1/2) <= k)."""
    return 1.0 - 2.0 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n


def min_units(level: float = LEVEL) -> int:
    """The fewest units for which the minimum and maximum already cover the median at `level`."""
    n = 1
    while coverage(n, 0) < level:
        n += 1
    return n


def unit_medians(values: Iterable[float], units: Iterable[Hashable]) -> dict[Hashable, float]:
    """Each unit's median of its own values (its repeats), in the order units first appear."""
    by_unit: dict[Hashable, list[float]] = {}
    for unit, value in zip(units, values, strict=True):
        by_unit.setdefault(unit, []).append(value)
    return {unit: statistics.median(vs) for unit, vs in by_unit.items()}


def over_units(values: Iterable[float], unit: str, level: float = LEVEL, repeats: int | None = None) -> dict:
    """The median of one value per unit, and a `level` interval for it or, with too few units, the
    range. Returns a JSON-ready dict:
        median, low, high   the median of the unit values and the bounds
        kind                "interval" (order statistics covering the median with probability
                            >= level) or "range" (min and max of too few units: no interval)
        level               the level asked for; coverage: what [low, high] reaches (for a range,
                            below level)
        n_units, unit       how many independent units, and what one is ("prompt", "group")
        repeats_per_unit    when the units' values are medians of repeats (informational)
    """
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError("no units: nothing to summarise")
    k = 0  # the largest k whose pair [x(k+1), x(n-k)] still covers the median at `level`
    while k + 1 <= (n - 1) // 2 and coverage(n, k + 1) >= level:
        k += 1
    cov = coverage(n, k)
    out = {"median": statistics.median(xs), "low": xs[k], "high": xs[n - 1 - k],
           "kind": "interval" if cov >= level else "range", "level": level, "coverage": cov,
           "n_units": n, "unit": unit}
    if repeats is not None:
        out["repeats_per_unit"] = repeats
    return out


def interval_or_none(stat: dict) -> list[float] | None:
    """[low, high] when `stat` is an interval; None when it is only a range."""
    return [stat["low"], stat["high"]] if stat["kind"] == "interval" else None


def describe(stat: dict, digits: int = 2, suffix: str = "×") -> str:
    """'1.35× [1.11, 1.53] (95% interval over 8 prompts)' or '1.07× (range 0.96–1.11 over 3 groups:
    too few for a 95% interval)'."""
    m, lo, hi, n = stat["median"], stat["low"], stat["high"], stat["n_units"]
    units = f"{n} {stat['unit']}{'' if n == 1 else 's'}"
    if stat["kind"] == "interval":
        return f"{m:.{digits}f}{suffix} [{lo:.{digits}f}, {hi:.{digits}f}] ({100 * stat['level']:.0f}% interval over {units})"
    return (f"{m:.{digits}f}{suffix} (range {lo:.{digits}f}–{hi:.{digits}f} over {units}: too few for a "
            f"{100 * stat['level']:.0f}% interval, which needs {min_units(stat['level'])})")


def read_results(path: Path) -> tuple[dict, tuple[int, int, int]]:
    """A results file and the identity of what was read (inode, size, mtime), for `rewrite_results`."""
    st = os.stat(path)
    return json.loads(Path(path).read_text(encoding="utf-8")), (st.st_ino, st.st_size, st.st_mtime_ns)


def rewrite_results(path: Path, doc: dict, read_as: tuple[int, int, int]) -> None:
    """Replace the results file read as `read_as` with `doc` (indented strict JSON, as the scripts
    write it), atomically; refused if the file changed since it was read."""
    path = Path(path)
    text = json.dumps(doc, indent=2, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        st = os.stat(path)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != read_as:
            raise SystemExit(f"{path} changed while it was recomputed; left as it is")
        os.chmod(tmp, st.st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
