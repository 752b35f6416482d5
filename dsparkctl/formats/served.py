"""Served acceptance: what vLLM and SGLang publish about speculation, read into counts.

Every source becomes a `ServedCounts` (scrapes: formats/served_scrape.py; response bodies:
formats/served_responses.py): K positions (the engine's maximum draft length), D
drafted verify steps, A accepted draft tokens, T proposed draft tokens, and whatever per-position
counts the source carries. Read in the engines' code (vLLM 0.32.0, SGLang 0.5.23; docs/served.md):

vLLM, Prometheus (`vllm/v1/spec_decode/metrics.py`), counters exposed with `_total`:
    vllm:spec_decode_num_drafts                 D (steps that proposed ≥ 1 draft token)
    vllm:spec_decode_num_draft_tokens           T
    vllm:spec_decode_num_accepted_tokens        A
    vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}   drafts whose token i+1 was
                                                accepted (0-based label), i = 0..K-1
    Labels `model_name` and `engine`: engines are summed, models kept apart (`model`).
    vLLM's per-position draft counts exist inside the engine but are not exported, so with drafts
    of different lengths the conditional acceptance past position 1 is only bounded.
vLLM, per request (`--per-request-spec-decode-metrics summary|detailed`), the response's
    `metrics.speculative_decoding`: acceptance_histogram [K+1] (steps that accepted exactly j),
    num_spec_steps, num_accepted_draft_tokens, num_draft_tokens, num_spec_tokens (K) and, when
    detailed, per_step_accepted / per_step_drafted (one entry per verify step: exact).
SGLang, per request, `meta_info` (`srt/managers/tokenizer_manager.py`): spec_verify_ct (D),
    spec_num_correct_drafts (A), spec_num_proposed_drafts (D × γ: nominal, whatever was
    verified), spec_correct_drafts_histogram (steps that accepted exactly j) and, under
    confidence-scheduled verification, spec_cap_lens_histogram (steps whose verify window, the
    bonus slot included, held n tokens: ℓ = n - 1 drafts).
SGLang, Prometheus: only gauges (`sglang:spec_accept_length`, the mean of its last logging
    interval): a τ with no counts behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from dsparkctl.errors import InputError

VLLM = "vllm:spec_decode_"
VLLM_COUNTERS = {"drafts": VLLM + "num_drafts", "draft_tokens": VLLM + "num_draft_tokens",
                 "accepted_tokens": VLLM + "num_accepted_tokens"}
VLLM_PER_POS = VLLM + "num_accepted_tokens_per_pos"
SGLANG_GAUGES = ("sglang:spec_accept_length", "sglang:spec_accept_rate")
MAX_POSITIONS = 256
_INT_LIMIT = 2 ** 53  # counters arrive as floats: beyond this they are no longer exact integers
SCRAPE_HINT = "save vLLM's /metrics with `curl -s http://HOST:PORT/metrics > scrape.txt`"
RESPONSES_HINT = ("save one response body per line: vLLM started with --per-request-spec-decode-metrics "
                  "detailed (or summary), or SGLang's /generate responses with their meta_info")


@dataclass
class ServedCounts:
    """What one engine reported, as counts (see the module doc)."""
    engine: str  # "vllm" | "sglang"
    kind: str  # "prometheus" | "prometheus-window" | "responses" | "gauges"
    positions: int = 0  # K (0: unknown, gauges only)
    drafts: int = 0  # D
    draft_tokens: int | None = None  # T (None: not reported)
    accepted_tokens: int = 0  # A
    accepted_at: list[int] | None = None  # [K] drafts that accepted position k (None: not reported)
    histogram: list[int] | None = None  # [K+1] steps that accepted exactly j drafts
    length_at_least: list[int | None] | None = None  # [K] steps that proposed ≥ k drafts (None: unknown)
    reached: list[int] | None = None  # [K] exact (per-step data): steps that tested position k
    requests: int | None = None
    model: str | None = None
    gauge_tau: float | None = None  # SGLang's gauge: a mean without counts
    notes: list[str] = field(default_factory=list)
    created: dict[str, dict[str, float]] = field(default_factory=dict)  # scrapes: counter -> engine -> creation time

    def check(self, where: str, allow_empty: bool = False) -> None:
        """The counts must be those of real drafts: every identity the engines guarantee.
        `allow_empty`: zero drafted steps is fine (the earlier scrape of a window)."""
        K, D = self.positions, self.drafts
        if self.kind == "gauges" or (allow_empty and D == 0):
            return
        if D == 0:
            raise InputError(f"{where}: no drafted steps (the counters are zero): speculation has not run yet, or "
                             "the server runs without it", "send requests first, or check the server's "
                             "speculative settings (vLLM --speculative-config, SGLang --speculative-algorithm)")
        least = 1 if self.engine == "vllm" else 0  # vLLM counts a step only if it drafted; SGLang every verify
        if self.draft_tokens is not None and not least * D <= self.draft_tokens <= K * D:
            raise InputError(f"{where}: {self.draft_tokens} draft tokens over {D} drafts of at most {K} is "
                             f"impossible (each draft proposes {least}..{K} tokens)", "the counters are inconsistent; "
                             "take them from one server and one scrape")
        for k, (acc, proposed) in enumerate(zip(self.accepted_at or [], self.length_at_least or [D])):
            if proposed is not None and acc > proposed:
                raise InputError(f"{where}: {acc} drafts accepted position {k + 1} but only {proposed} proposed it",
                                 "the counts are inconsistent")
        if self.accepted_at is not None and self.draft_tokens is not None and \
                sum(self.accepted_at[1:]) > self.draft_tokens - least * D:
            raise InputError(f"{where}: {sum(self.accepted_at[1:])} tokens accepted past position 1, but the "
                             f"{D} drafts proposed only {self.draft_tokens - least * D} tokens past their first",
                             "the counters are inconsistent; take them from one server and one scrape")
        if self.accepted_at is not None:
            a = [D, *self.accepted_at]
            if any(a[k + 1] > a[k] for k in range(K)):
                raise InputError(f"{where}: accepted counts rise with position ({self.accepted_at}); a draft "
                                 "accepted at position k was accepted at k-1", "the per-position series are "
                                 "inconsistent; take them from one scrape")
            if sum(self.accepted_at) != self.accepted_tokens:
                raise InputError(f"{where}: the per-position accepted counts sum to {sum(self.accepted_at)}, the "
                                 f"accepted-token total is {self.accepted_tokens}", "the counters are inconsistent; "
                                 "take them from one server and one scrape")
        elif self.accepted_tokens > K * D:
            raise InputError(f"{where}: {self.accepted_tokens} accepted tokens over {D} drafts of at most {K}",
                             "the counters are inconsistent")
        if self.draft_tokens is not None and self.accepted_tokens > self.draft_tokens:
            raise InputError(f"{where}: more accepted tokens ({self.accepted_tokens}) than draft tokens "
                             f"({self.draft_tokens})", "the counters are inconsistent")

    def add(self, other: "ServedCounts", where: str) -> "ServedCounts":
        """Both sets of steps (one engine, one K)."""
        if (other.engine, other.positions) != (self.engine, self.positions):
            raise InputError(f"{where}: {other.engine} with {other.positions} positions cannot be pooled with "
                             f"{self.engine} with {self.positions}", "read one server's output at a time")

        def plus(a, b):
            if a is None or b is None:
                return None
            if isinstance(a, list):
                return [None if x is None or y is None else x + y for x, y in zip(a, b)]
            return a + b
        return ServedCounts(
            engine=self.engine, kind=self.kind, positions=self.positions, drafts=self.drafts + other.drafts,
            draft_tokens=plus(self.draft_tokens, other.draft_tokens),
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
            accepted_at=plus(self.accepted_at, other.accepted_at), histogram=plus(self.histogram, other.histogram),
            length_at_least=plus(self.length_at_least, other.length_at_least),
            reached=plus(self.reached, other.reached), requests=plus(self.requests, other.requests),
            model=self.model, notes=self.notes + [n for n in other.notes if n not in self.notes])


def _count(value: Any, what: str, where: str) -> int:
    """A reported count: a finite, non-negative whole number (counters arrive as floats)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: {what} is {str(value)[:40]!r}, not a number", "the source is damaged or not an "
                         "engine's output")
    if not math.isfinite(value) or value < 0 or value != int(value) or value >= _INT_LIMIT:
        raise InputError(f"{where}: {what} is {value!r}; counts are whole numbers ≥ 0", "the source is damaged, or "
                         "was edited; take a fresh scrape or responses")
    return int(value)


def _histogram_counts(hist: Sequence[int], K: int) -> tuple[list[int], int]:
    """accepted_at [K] and A from a histogram of accepted drafts per step."""
    acc = [sum(hist[k:]) for k in range(1, K + 1)]
    return acc, sum(j * n for j, n in enumerate(hist))
