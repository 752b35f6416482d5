"""What a clone carries stays small from now on: result files are summaries (a raw per-round dump
belongs outside git, with the command that regenerates it), and one shipped draft's weights."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_RESULT_BYTES = 3 << 19  # 1.5 MiB: the largest summary kept (policies_paired.json) is 1.2 MiB
MAX_DRAFT_BYTES = 32 << 20  # the shipped draft is about 24 MB


def test_result_files_are_summaries():
    big = [(p.relative_to(ROOT), p.stat().st_size) for p in (ROOT / "benchmarks" / "results").rglob("*")
           if p.is_file() and p.stat().st_size > MAX_RESULT_BYTES]
    assert not big, f"result files over {MAX_RESULT_BYTES >> 10} KiB (keep a summary and the command instead): {big}"


def test_one_shipped_draft_of_bounded_size():
    weights = list((ROOT / "dsparkctl" / "assets" / "drafts").rglob("*.safetensors"))
    assert len(weights) == 1 and weights[0].stat().st_size <= MAX_DRAFT_BYTES, weights
