"""Draft-free baselines: what a unigram and a bigram guess reach, teacher-forced and greedy.

A draft that does not beat these is not yet using the target's features. Both are fitted on
training continuations (counts of the target's own output tokens) and scored exactly like a
draft in teacher-forced greedy evaluation: at anchor a, slot k guesses x̂_k from the previous
TRUE token (x_a for k = 1, then x*_{k-1}), and β_k(a) = 1 if x̂_k is the target's argmax there.
Chained on its own guesses the bigram would reach the same survival, since survival only counts
blocks whose earlier guesses were all right.

    unigram:  x̂ = the most frequent output token
    bigram:   x̂ = argmax_t count(prev → t) (falls back to the unigram for unseen prev)
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from dsparkctl.evaluation.teacher_forced import TeacherForcedStats


class NGramGuess:
    """Unigram (order 1) or bigram (order 2) argmax guesser over a vocabulary of size V."""

    def __init__(self, order: int, vocab_size: int):
        if order not in (1, 2):
            raise ValueError("order must be 1 or 2")
        self.order, self.V = order, vocab_size
        self.uni = torch.zeros(vocab_size, dtype=torch.long)
        self.bi: dict[int, torch.Tensor] = {}

    def fit(self, continuations: Iterable[tuple[Sequence[int], int]]) -> "NGramGuess":
        """continuations: (tokens, prompt_len) pairs; counts the response tokens and their predecessors."""
        pairs: dict[int, dict[int, int]] = {}
        for toks, P in continuations:
            t = list(toks)
            for i in range(max(P, 1), len(t)):
                self.uni[t[i]] += 1
                d = pairs.setdefault(t[i - 1], {})
                d[t[i]] = d.get(t[i], 0) + 1
        self.mode = int(self.uni.argmax())
        # argmax successor per predecessor (ties: lower id)
        self.next = torch.full((self.V,), self.mode, dtype=torch.long)
        for prev, d in pairs.items():
            best = max(d.items(), key=lambda kv: (kv[1], -kv[0]))[0]
            self.next[prev] = best
        return self

    def guess(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: [...] previous true tokens -> guesses [...]."""
        if self.order == 1:
            return torch.full_like(prev, self.mode)
        return self.next[prev]


def baseline_stats(guesser: NGramGuess, sequences: Iterable[tuple[Sequence[int], int, Sequence[int]]],
                   gamma: int) -> TeacherForcedStats:
    """sequences: (tokens, prompt_len, argmax) where argmax[j] is the target's argmax for the token
    at prompt_len + j (for greedy continuations it is the token itself)."""
    stats = TeacherForcedStats(block_size=gamma)
    for toks, P, amax in sequences:
        t = torch.as_tensor(list(toks), dtype=torch.long)
        am = torch.as_tensor(list(amax), dtype=torch.long)
        S = len(t)
        anchors = torch.arange(P, max(P, S - gamma))
        if anchors.numel() == 0:
            continue
        idx = anchors[:, None] + torch.arange(gamma)  # [A, γ] position of the previous token of slot k
        guess = guesser.guess(t[idx])  # [A, γ] guess for the token at idx+1
        stats.add((guess == am[idx + 1 - P]).float())
    return stats
