"""Seeded, time-bounded fuzzing of the trace, SPS-table and calibration readers over mutated valid
files: every outcome is a one-line domain error or a result that satisfies the format's
invariants (and that the consumers downstream accept or refuse with one line) — never anything else."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from dsparkctl.errors import DsparkError
from dsparkctl.formats.calibration import load_temperatures
from dsparkctl.formats.sps import load_sps_table, table_json
from dsparkctl.formats.trace import MAX_BLOCK_SIZE, read_trace, write_synthetic_trace
from dsparkctl.formats.trace_scan import read_round_table
from dsparkctl.math.sps import MAX_BATCH_TOKENS, MAX_STEPS_PER_SEC
from dsparkctl.math.synthetic import SyntheticModel
from dsparkctl.tuning.calibration import calibration_data
from dsparkctl.tuning.sweep import load_replay_rounds

BUDGET_S = 1.5  # per reader
PALETTE: list[Any] = [None, True, False, -1, 0, 1, 3, 5, 2 ** 63, 10 ** 30, -0.0, 0.5, 1e308, -1e308, 1e-320,
                      "5", "", "NaN", [], {}, [1.0], [0.1] * 5, [[1]], {"a": 1}]
RAW_VALUES = ["NaN", "Infinity", "-Infinity", "1e400", "01", "1.", "\"\\ud800\"", "tru"]


def _mutate_json(doc: Any, rng: random.Random) -> Any:
    """Replace one value somewhere in `doc` (a key, a list item, or the whole) with a palette value."""
    if isinstance(doc, dict) and doc and rng.random() < 0.85:
        k = rng.choice(list(doc))
        action = rng.random()
        if action < 0.15:
            return {kk: v for kk, v in doc.items() if kk != k}  # drop a key
        return {**doc, k: _mutate_json(doc[k], rng)}
    if isinstance(doc, list) and doc and rng.random() < 0.8:
        i = rng.randrange(len(doc))
        action = rng.random()
        if action < 0.15:
            return doc[:i] + doc[i + 1:]
        if action < 0.3:
            return doc[:i] + [doc[i]] + doc[i:]
        return doc[:i] + [_mutate_json(doc[i], rng)] + doc[i + 1:]
    return rng.choice(PALETTE)


def _mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    kind = rng.randrange(6)
    pos = rng.randrange(len(b)) if b else 0
    if kind == 0 and b:
        b[pos] = rng.randrange(256)
    elif kind == 1:
        b[pos:pos] = bytes([rng.choice([0x00, 0x0A, 0x22, 0x2C, 0x7B, 0x7D, 0xFF, 0xC3])])
    elif kind == 2:
        del b[pos:pos + rng.randrange(1, 40)]
    elif kind == 3:
        b = b[:pos]
    elif kind == 4:  # a raw token JSON allows in Python only, or not at all
        b[pos:pos] = rng.choice(RAW_VALUES).encode()
    else:  # a line twice, or two lines swapped
        lines = bytes(b).split(b"\n")
        i = rng.randrange(len(lines))
        lines.insert(i, lines[rng.randrange(len(lines))])
        b = bytearray(b"\n".join(lines))
    return bytes(b)


def _fuzz(seed: int, valid: bytes, path: Path, mutate_doc: Callable[[bytes, random.Random], bytes],
          check: Callable[[Path], None]) -> int:
    rng = random.Random(seed)
    n, deadline = 0, time.monotonic() + BUDGET_S
    while time.monotonic() < deadline:
        raw = valid
        for _ in range(rng.randint(1, 3)):
            raw = mutate_doc(raw, rng) if rng.random() < 0.6 else _mutate_bytes(raw, rng)
        path.write_bytes(raw)
        try:
            check(path)
        except DsparkError as exc:
            assert "\n" not in exc.one_line() and exc.one_line().strip(), exc.one_line()
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"seed {seed}, case {n}: {type(exc).__name__}: {exc}\n{raw[:2000]!r}")
        n += 1
    return n


# --------------------------------------------------------------------------- traces
def _mutate_trace(raw: bytes, rng: random.Random) -> bytes:
    lines = raw.split(b"\n")
    i = rng.randrange(max(1, len(lines) - 1))  # the last line is empty
    try:
        doc = json.loads(lines[i])
    except ValueError:
        return _mutate_bytes(raw, rng)
    lines[i] = json.dumps(_mutate_json(doc, rng)).encode()
    return b"\n".join(lines)


def _check_trace(path: Path) -> None:
    t = read_trace(path)
    seen = set()
    for r in t.rounds:
        assert 1 <= r.block_size <= MAX_BLOCK_SIZE and 0 <= r.accepted <= r.verify_length <= r.block_size
        assert all(0 <= v < 2 ** 63 for v in (r.request, r.round, r.batch_tokens))
        assert math.isfinite(r.draft_ms) and math.isfinite(r.verify_ms) and isinstance(r.budget_capped, bool)
        assert r.confidence_logits is None or (len(r.confidence_logits) == r.block_size
                                               and all(math.isfinite(x) for x in r.confidence_logits))
        assert (r.request, r.round) not in seen
        seen.add((r.request, r.round))
    for consumer in (lambda: load_replay_rounds([path]), lambda: calibration_data(read_round_table([path], "fuzz"))):
        try:
            consumer()
        except DsparkError as exc:
            assert "\n" not in exc.one_line()


@pytest.mark.parametrize("seed", [0, 1])
def test_trace_reader(seed: int, tmp_path: Path):
    write_synthetic_trace(tmp_path / "valid.jsonl", SyntheticModel(), 3, 4, seed=seed)
    n = _fuzz(seed, (tmp_path / "valid.jsonl").read_bytes(), tmp_path / "t.jsonl", _mutate_trace, _check_trace)
    assert n >= 50, f"only {n} cases in {BUDGET_S} s"


# --------------------------------------------------------------------------- SPS tables and calibrations
def _mutate_doc(raw: bytes, rng: random.Random) -> bytes:
    try:
        return json.dumps(_mutate_json(json.loads(raw), rng)).encode()
    except ValueError:
        return _mutate_bytes(raw, rng)


def _check_sps(path: Path) -> None:
    t = load_sps_table(path)
    assert all(1 <= b <= MAX_BATCH_TOKENS for b in t.batch_tokens)
    assert all(b < c for b, c in zip(t.batch_tokens, t.batch_tokens[1:]))
    assert all(0 < s <= MAX_STEPS_PER_SEC for s in t.steps_per_sec)
    json.dumps(table_json(t), allow_nan=False)
    probe = torch.tensor([0.0, 1.0, t.batch_tokens[-1], 3.0 * t.batch_tokens[-1], 2.0 ** 31])
    for table in (load_sps_table(path, extrapolate="clamp"), load_sps_table(path, mode="linear", extrapolate="linear")):
        v = table.sps(probe)
        assert bool(torch.isfinite(v).all()) and bool((v > 0).all()) and float(v.max()) <= MAX_STEPS_PER_SEC, v


SPS_VALID = [
    {"format": "dsparkctl-sps/1", "batch_tokens": [1, 4, 16, 64], "steps_per_sec": [100.0, 80.0, 40.0, 12.0],
     "max_batch_tokens": 128, "lookup": "floor", "extrapolate": "linear", "provenance": {"tool": "dsparkctl"}},
    {"sample_batch_tokens": [1, 2, 8], "sample_steps_per_sec": [30.0, 29.0, 20.0], "max_batch_tokens": 8},
]


@pytest.mark.parametrize("seed,valid", [(0, SPS_VALID[0]), (1, SPS_VALID[1])], ids=["ours", "sglang"])
def test_sps_reader(seed: int, valid: dict, tmp_path: Path):
    n = _fuzz(seed, json.dumps(valid).encode(), tmp_path / "sps.json", _mutate_doc, _check_sps)
    assert n >= 50, f"only {n} cases in {BUDGET_S} s"


def _check_calibration(path: Path) -> None:
    temps = load_temperatures(path, gamma=5)
    assert len(temps) == 5 and all(math.isfinite(x) and x > 0 for x in temps)


def test_calibration_reader(tmp_path: Path):
    valid = json.dumps({"temperatures": [2.5, 2.4, 2.6, 2.5, 2.5], "dataset": "t.jsonl", "num_samples": 80}).encode()
    n = _fuzz(2, valid, tmp_path / "calib.json", _mutate_doc, _check_calibration)
    assert n >= 50, f"only {n} cases in {BUDGET_S} s"


# --------------------------------------------------------------------------- training recipes (TOML)
def _toml_value(v: Any) -> str | None:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string
    if isinstance(v, list):
        items = [_toml_value(x) for x in v]
        return None if any(x is None for x in items) else "[" + ", ".join(items) + "]"
    return None  # None and tables inside values: TOML has no spelling for them here


def _dump_toml(doc: dict) -> bytes:
    lines = []
    for k, v in doc.items():
        if not isinstance(v, dict) and _toml_value(v) is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f"[{k}]")
            lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items() if _toml_value(vv) is not None]
    return ("\n".join(lines) + "\n").encode()


def _mutate_recipe(raw: bytes, rng: random.Random) -> bytes:
    import tomllib

    try:
        doc = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return _mutate_bytes(raw, rng)
    mutated = _mutate_json(doc, rng)
    return _dump_toml(mutated) if isinstance(mutated, dict) else _mutate_bytes(raw, rng)


def _check_recipe(path: Path) -> None:
    from dsparkctl.train.recipe import load_recipe, validate

    r = load_recipe(path)
    validate(r, str(path))  # what load_recipe returned passes its own validation
    assert r.optim.lr > 0 and math.isfinite(r.optim.lr) and r.optim.steps >= 1 and r.draft.block_size >= 1
    assert all(isinstance(i, int) for i in r.draft.layer_ids) and max(r.optim.loss_weights) > 0
    json.dumps(r.to_dict(), allow_nan=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_recipe_reader(seed: int, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # init_from paths in mutated recipes resolve here, where nothing is
    root = Path(__file__).resolve().parents[1]
    valid = (root / "recipes" / "smollm2-135m-dspark.toml").read_bytes()
    n = _fuzz(seed, valid, tmp_path / "r.toml", _mutate_recipe, _check_recipe)
    assert n >= 50, f"only {n} cases in {BUDGET_S} s"


def test_json_nested_past_the_parser_is_a_strict_json_error():
    """Python's parser recurses: 100,000 brackets would be a RecursionError (an internal error at
    every reader); loads says it is too deeply nested, which every reader turns into one line."""
    from dsparkctl.strict_json import StrictJSONError, loads

    with pytest.raises(StrictJSONError, match="nested too deeply"):
        loads("[" * 100_000 + "]" * 100_000)


# --------------------------------------------------------------------------- served acceptance
def _served_valid(kind: str) -> bytes:
    """A valid source of each kind `dsparkctl served` reads (see tests/test_served.py)."""
    from tests.test_served import VllmServer, rounds, sglang_responses, vllm_responses

    import tempfile
    steps = rounds(200, lengths=(5, 3), seed=7)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x"
        if kind == "scrape":
            VllmServer(engines=2).feed(steps).scrape(p)
        elif kind == "vllm":
            vllm_responses(p, steps, per_request=40)
        else:
            sglang_responses(p, steps, per_request=40)
        return p.read_bytes()


def _mutate_lines(raw: bytes, rng: random.Random) -> bytes:
    lines = raw.split(b"\n")
    i = rng.randrange(max(1, len(lines) - 1))
    try:
        doc = json.loads(lines[i])
    except ValueError:  # a scrape line: swap one number or label for a palette value
        words = lines[i].split(b" ")
        words[-1] = str(rng.choice(PALETTE + RAW_VALUES)).encode()
        lines[i] = b" ".join(words)
        return b"\n".join(lines)
    lines[i] = json.dumps(_mutate_json(doc, rng)).encode()
    return b"\n".join(lines)


def _check_served(path: Path) -> None:
    from dsparkctl.serving.served import read_sources, served_report

    doc = served_report(read_sources([str(path)]), [str(path)])
    json.dumps(doc, allow_nan=False)  # strict JSON
    D = doc["drafts"]
    assert D and D > 0 and doc["tau"] >= 1.0
    prev = D
    for p in doc["per_position"]:
        assert 0 <= p["accepted"] <= prev
        lo, hi = p["tested_bounds"]
        assert p["accepted"] <= lo <= hi <= prev
        if p["conditional"] is not None:
            assert 0.0 <= p["conditional"] <= 1.0
        prev = p["accepted"]


@pytest.mark.parametrize("kind", ["scrape", "vllm", "sglang"])
def test_served_readers(kind: str, tmp_path: Path):
    n = _fuzz(3, _served_valid(kind), tmp_path / "source", _mutate_lines, _check_served)
    assert n >= 50, f"only {n} cases in {BUDGET_S} s"
