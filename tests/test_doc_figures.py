"""Every figure the docs quote from a results file is the number in that file.

The convention (also in benchmarks/README.md, "Citing a figure"): a figure is quoted in a
*figures table*, a Markdown table with a column whose header starts with "Results file".

- Each row names its results file in that column, as `benchmarks/results/NAME.json` (in
  backticks); a row may leave the cell empty when the column's header names the file for every row.
- A column whose header holds a JSON pointer in backticks, `#/a/b`, quotes in every row the value
  at that pointer in the row's file. `{name}` in a header's pointer stands for the row's text in
  the column headed `name` (e.g. `#/cells/batch_size={batch},policy=dspark/ratio_over_groups`).
- A column headed "Value" quotes the values at the pointers written after the file in the row's
  results-file cell: `benchmarks/results/NAME.json#/a/b` (and further `#/c` in backticks).
- Pointers are RFC 6901 JSON pointers (`~1` for `/` in a key); a segment `k=v,k2=v2` on a list picks
  the one element whose fields have those values.
- A cell's pointers take the cell's numbers in order, each matched as written (to the decimals
  written; `%` after a number: a percentage of a share; `2,950` is 2950):
    a number            one number;
    a pair [lo, hi]     two numbers;
    a statistic of `benchmarks/unit_stats.py` (median, low, high, kind, n_units, unit): the median,
                        then `[low, high]` where `kind` is "interval" (a 95% interval over the units)
                        or `(range low–high)` where it is "range" (too few units for an interval),
                        and the row says how many units: "8 prompts", "3 groups".
  A cell of "–" quotes nothing.
- A bold ratio (`**1.19×**`) must be a statistic whose interval excludes 1: no bolded gain from a
  range or from an interval that holds 1.
- Where a table has a column headed "Command", the row's command must name the script (or the
  `dsparkctl` command) that the file's `provenance` says wrote it.

And README.md quotes no ratio (`1.35×`) or τ figure outside such a table.

Only JSON and Markdown are read: the whole file runs in well under a second.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "design").glob("*.md"))]

FILE = re.compile(r"`(benchmarks/results/[\w.,{}/-]+\.json)((?:#/[^`]*)?)`")
POINTER = re.compile(r"`(?:benchmarks/results/[\w.,{}/-]+\.json)?#(/[^`]*)`")
NUMBER = re.compile(r"(?<![\w.:/=#~-])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(%?)")
INTERVAL = re.compile(r"[\s×*]*\[\s*")
RANGE = re.compile(r"[\s×*]*\(range\s+")


# ---------------------------------------------------------------------------------------------
# reading tables and pointers


def split_row(line: str) -> list[str]:
    """A table row's cells: split at `|` outside backticks (`a.json|png` stays one cell)."""
    cells, cell, code = [], "", False
    for ch in line.strip().strip("|") if line.strip().endswith("|") else line.strip()[1:]:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    cells.append(cell.strip())
    return cells


def tables(text: str) -> list[tuple[int, list[str], list[tuple[int, list[str]]]]]:
    """(line number of the header, header cells, [(line number, cells)]) for every Markdown table
    outside fenced blocks."""
    found, fenced, lines = [], False, text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith(("```", "~~~")):
            fenced = not fenced
        elif (not fenced and line.startswith("|") and i + 1 < len(lines)
              and re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", lines[i + 1].strip())):
            header, rows = split_row(line), []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append((i + 1, split_row(lines[i])))
                i += 1
            found.append((i - len(rows) - 1, header, rows))
            continue
        i += 1
    return found


def plain_header(cell: str) -> str:
    return re.sub(r"`[^`]*`", "", cell).replace("*", "").strip().lower()


def resolve(doc, pointer: str):
    """The value at a JSON pointer (RFC 6901), lists also indexed by `k=v,k2=v2` selectors."""
    node = doc
    for raw in pointer.split("/")[1:]:
        seg = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            if seg.isdigit():
                node = node[int(seg)]
                continue
            want = dict(part.split("=", 1) for part in seg.split(","))
            hits = [x for x in node if isinstance(x, dict) and all(str(x.get(k)) == v for k, v in want.items())]
            if len(hits) != 1:
                raise KeyError(f"{seg!r} selects {len(hits)} elements")
            node = hits[0]
        else:
            node = node[seg]
    return node


def is_statistic(value) -> bool:
    return isinstance(value, dict) and {"median", "low", "high", "kind", "n_units", "unit"} <= set(value)


def matches(written: str, decimals: str, percent: str, value: float) -> bool:
    w = float(written.replace(",", "") + decimals)
    v = 100 * value if percent else value
    return abs(w - v) <= 0.5 * 10 ** -max(len(decimals) - 1, 0) + 1e-9


def number_at(text: str, pos: int):
    m = NUMBER.search(text, pos)
    if m is None:
        raise ValueError(f"no number left in {text!r} after position {pos}")
    return m


def check_cell(cell: str, values: list, row_text: str) -> list[str]:
    """What is wrong with a cell quoting `values` (module docstring); [] when it quotes them right."""
    errors, pos = [], 0
    try:
        for value in values:
            if is_statistic(value):
                m = number_at(cell, pos)
                bold = cell[:m.start()].count("**") % 2 == 1
                if not matches(m.group(1), m.group(2) or "", "", value["median"]):
                    errors.append(f"median written {m.group(0)}, the file has {value['median']:.4g}")
                pattern = INTERVAL if value["kind"] == "interval" else RANGE
                bounds = pattern.match(cell, m.end())
                if bounds is None:
                    shape = "[low, high]" if value["kind"] == "interval" else "(range low–high)"
                    errors.append(f"{m.group(0)} is a {value['kind']} in the file: write it as {shape}")
                    pos = m.end()
                    continue
                lo = number_at(cell, bounds.end())
                hi = number_at(cell, lo.end())
                for got, want in ((lo, value["low"]), (hi, value["high"])):
                    if not matches(got.group(1), got.group(2) or "", "", want):
                        errors.append(f"bound written {got.group(0)}, the file has {want:.4g}")
                n, unit = value["n_units"], value["unit"]
                if f"{n} {unit}{'' if n == 1 else 's'}" not in row_text:
                    errors.append(f"the row does not say its units: '{n} {unit}{'' if n == 1 else 's'}'")
                if bold and "×" in cell and not (value["kind"] == "interval" and (value["low"] > 1 or value["high"] < 1)):
                    errors.append(f"{m.group(0)} is bold, but its {value['kind']} [{value['low']:.3f}, "
                                  f"{value['high']:.3f}] does not exclude 1: no gain (or loss) is shown")
                pos = hi.end()
            elif isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) for v in value):
                for want in value:
                    m = number_at(cell, pos)
                    if not matches(m.group(1), m.group(2) or "", m.group(3), want):
                        errors.append(f"written {m.group(0)}, the file has {want:.4g}")
                    pos = m.end()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                m = number_at(cell, pos)
                if not matches(m.group(1), m.group(2) or "", m.group(3), value):
                    errors.append(f"written {m.group(0)}, the file has {value:.4g}")
                pos = m.end()
            else:
                errors.append(f"the pointer names {type(value).__name__}, not a figure")
    except ValueError as e:
        errors.append(str(e))
    return errors


def provenance_command(doc: dict) -> str | None:
    """What wrote a results file, as a command cell must name it: a script's file name, or
    `dsparkctl <command>` for a file the CLI wrote."""
    prov = doc.get("provenance")
    if not isinstance(prov, dict):
        return None
    cmd = prov.get("command")
    if isinstance(cmd, list) and cmd:
        return Path(cmd[0]).name
    if isinstance(cmd, str):
        return f"dsparkctl {cmd}"
    return None


def check_text(text: str, root: Path = ROOT, name: str = "doc") -> tuple[list[str], int]:
    """(every disagreement between a text's figures tables and their files, how many figures were
    checked)."""
    errors, checked, cache = [], 0, {}

    def load(path: str):
        if path not in cache:
            cache[path] = json.loads((root / path).read_text(encoding="utf-8"))
        return cache[path]

    for _, header, rows in tables(text):
        cols = [plain_header(h) for h in header]
        files = [j for j, h in enumerate(cols) if h.startswith("results file")]
        if not files:
            continue
        fcol = files[0]
        header_file = FILE.search(header[fcol])
        value_cols = {j: POINTER.findall(h) for j, h in enumerate(header) if j != fcol and POINTER.search(h)}
        value_cols.update({j: None for j, h in enumerate(cols) if h == "value"})
        command_col = next((j for j, h in enumerate(cols) if h.startswith("command")), None)
        for line_no, cells in rows:
            where = f"{name}:{line_no}"
            if len(cells) != len(header):
                errors.append(f"{where}: {len(cells)} cells under a header of {len(header)}")
                continue
            m = FILE.search(cells[fcol]) or header_file
            if m is None:
                errors.append(f"{where}: no `benchmarks/results/….json` in the results-file column")
                continue
            path = m.group(1)
            if not (root / path).is_file():
                errors.append(f"{where}: {path} does not exist")
                continue
            doc = load(path)
            row_text = " ".join(cells)
            for j, pointers in value_cols.items():
                if cells[j] in ("–", "-", ""):
                    continue
                if pointers is None:  # the Value column: the pointers after the row's file
                    pointers = POINTER.findall(cells[fcol])
                pointers = [re.sub(r"\{([^{}]+)\}", lambda g: cells[cols.index(g.group(1).lower())].strip("` *"), p)
                            for p in pointers]
                if not pointers:
                    errors.append(f"{where}: column {header[j]!r} quotes a figure with no pointer into {path}")
                    continue
                try:
                    values = [resolve(doc, p) for p in pointers]
                except (KeyError, IndexError, ValueError, TypeError) as e:
                    errors.append(f"{where}: {path}#{pointers}: no such key ({e})")
                    continue
                errors += [f"{where}: {path}#{'; '.join(pointers)}: {e}" for e in check_cell(cells[j], values, row_text)]
                checked += len(values)
            if command_col is not None and (wrote := provenance_command(doc)) and wrote not in cells[command_col]:
                errors.append(f"{where}: the command cell does not name {wrote!r}, which wrote {path}")
    return errors, checked


def figures_outside_tables(text: str) -> list[str]:
    """Lines of prose (not fenced, not a figures-table row) that quote a ratio or a τ figure."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced or (s.startswith("|") and "benchmarks/results/" in s) or s.startswith("|---"):
            continue
        if re.search(r"\d\s*×(?!\s*\d)|τ\s*(?:≈|=|≥)?\s*\d", s):
            out.append(f"{n}: {s}")
    return out


# ---------------------------------------------------------------------------------------------
# the docs


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_figures_are_the_files_figures(doc):
    errors, _ = check_text(doc.read_text(encoding="utf-8"), name=str(doc.relative_to(ROOT)))
    assert not errors, "figures that disagree with their results files:\n  " + "\n  ".join(errors)


def test_the_readme_quotes_its_figures_in_tables():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    errors, checked = check_text(text)
    assert checked >= 10 and not errors  # a small table: every other figure lives on its page
    loose = figures_outside_tables(text)
    assert not loose, ("README.md quotes figures outside its figures table (give each a row: value, units, "
                       "command, results file):\n  " + "\n  ".join(loose))


def test_the_speed_pages_quote_through_tables():
    """The pages that carry the speed figures quote them through figures tables."""
    for page, at_least in (("docs/generate.md", 20), ("docs/scheduling.md", 40), ("docs/train.md", 6)):
        _, checked = check_text((ROOT / page).read_text(encoding="utf-8"))
        assert checked >= at_least, f"{page}: {checked} figures checked against their files"


def test_a_drifted_number_fails(tmp_path):
    """Copy README's first cited file, nudge the cited figure, and the check names it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = next(FILE.search(cells[[plain_header(h) for h in header].index("results file")])
                 for _, header, rows in tables(text) for _, cells in rows
                 if any(plain_header(h) == "results file" for h in header))
    path, pointer = first.group(1), first.group(2)[1:]
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results",
                    ignore=shutil.ignore_patterns("*.png", "*.jsonl", "calibration"))
    assert check_text(text, root=tmp_path)[0] == []  # the copy agrees
    doc = json.loads((tmp_path / path).read_text(encoding="utf-8"))
    target = resolve(doc, pointer)
    if is_statistic(target):
        target["median"] *= 1.03  # a 3% drift
    else:
        parent = resolve(doc, pointer.rsplit("/", 1)[0] or "")
        parent[pointer.rsplit("/", 1)[1]] *= 1.03
    (tmp_path / path).write_text(json.dumps(doc), encoding="utf-8")
    errors, _ = check_text(text, root=tmp_path)
    assert errors and all(path in e for e in errors), errors


# ---------------------------------------------------------------------------------------------
# the checker itself


def write(tmp_path: Path, name: str, doc: dict) -> None:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
    (tmp_path / "benchmarks" / "results" / name).write_text(json.dumps(doc), encoding="utf-8")


def stat(median, low, high, kind, n, unit="prompt"):
    return {"median": median, "low": low, "high": high, "kind": kind, "n_units": n, "unit": unit}


def test_the_convention(tmp_path):
    write(tmp_path, "x.json", {"r": {"a": stat(1.354, 1.09, 1.99, "interval", 8), "b": stat(1.07, 0.96, 1.11, "range", 3,
                                                                                          "group")},
                               "ms": {"int8": 3.11, "fp32": 4.432}, "share": 0.35, "iv": [2.358, 2.8015],
                               "cells": [{"batch_size": 1, "policy": "p", "v": 1.5}, {"batch_size": 4, "policy": "p",
                                                                                      "v": 2.5}],
                               "provenance": {"command": ["benchmarks/bench_x.py", "--out", "x"]}})
    good = """
| Figure | Value | Units | Command | Results file |
|---|---|---|---|---|
| a | **1.35×** [1.09, 1.99] | 8 prompts | `python benchmarks/bench_x.py` | `benchmarks/results/x.json#/r/a` |
| b | 1.07× (range 0.96–1.11), drafted 35% | 3 groups | `bench_x.py` | `benchmarks/results/x.json#/r/b` `#/share` |
| ms | 3.11 ms against 4.43 | – | `bench_x.py` | `benchmarks/results/x.json#/ms/int8` `#/ms/fp32` |
| τ | 2.36–2.80 | – | `bench_x.py` | `benchmarks/results/x.json#/iv` |

| batch | p `#/cells/batch_size={batch},policy=p/v` | Results file `benchmarks/results/x.json` |
|---|---|---|
| 1 | 1.50 | |
| 4 | 2.5 | |
"""
    errors, checked = check_text(good, root=tmp_path)
    assert errors == [] and checked == 8
    cases = [
        (good.replace("**1.35×** [1.09, 1.99]", "**1.36×** [1.09, 1.99]"), "median written 1.36"),
        (good.replace("**1.35×** [1.09, 1.99]", "**1.35×** (range 1.09–1.99)"), "write it as [low, high]"),
        (good.replace("1.07× (range 0.96–1.11)", "1.07× [0.96, 1.11]"), "write it as (range low–high)"),
        (good.replace("1.07× (range 0.96–1.11)", "**1.07×** (range 0.96–1.11)"), "does not exclude 1"),
        (good.replace("| 8 prompts |", "| 8 runs |"), "does not say its units"),
        (good.replace("drafted 35%", "drafted 36%"), "written 36%"),
        (good.replace("4.43", "4.53"), "written 4.53,"),
        (good.replace("| 4 | 2.5 |", "| 4 | 2.6 |"), "written 2.6"),
        (good.replace("`python benchmarks/bench_x.py`", "`python benchmarks/bench_y.py`"), "does not name 'bench_x.py'"),
        (good.replace("x.json#/r/a", "x.json#/r/c"), "no such key"),
        (good.replace("x.json#/r/a", "y.json#/r/a"), "y.json does not exist"),
    ]
    for text, why in cases:
        errors, _ = check_text(text, root=tmp_path)
        assert any(why in e for e in errors), (why, errors)


def test_numbers_and_rows():
    assert split_row("| a | `x.json|png` | b |") == ["a", "`x.json|png`", "b"]
    assert [m.group(0) for m in NUMBER.finditer("static:2 at 2,950 ms, 1.5×, 35% of stage-4")] == ["2,950", "1.5", "35%"]
    assert matches("1", ".35", "", 1.354) and not matches("1", ".35", "", 1.356)
    assert matches("35", "", "%", 0.354) and matches("2,950", "", "", 2950.4)
    assert resolve({"a": [{"k": 1, "v": 2}, {"k": 3, "v": 4}], "b/c": 5}, "/a/k=3/v") == 4
    assert resolve({"b/c": 5}, "/b~1c") == 5
    assert figures_outside_tables("x 1.35× y\n| a | 1.3× | `benchmarks/results/x.json` |\n```\n2×\n```\nτ 1.7\n") == \
        ["1: x 1.35× y", "6: τ 1.7"]
