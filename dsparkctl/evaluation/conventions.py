"""Which slot convention and target-layer count a draft was trained with, measured.

A draft read with the wrong slot convention (which token slot k predicts) or with its target layer
ids off by one loads without an error and drafts almost nothing right: a loader cannot tell, the
acceptance can. For every candidate reading — sample_from_anchor true or false, the layer ids as
read or shifted by ±1 — the same weights are scored teacher-forced on a few target continuations
(the target's greedy ones), and position 1's conditional acceptance c₁ names the reading that fits. c₁ is the
sampled-acceptance one, β = Σ_v min(p, q) at temperature 1: it is exact (no sampling) and
continuous, so a small but consistent loss (a tap one layer off in a model whose neighbouring
layers look alike) separates from noise where the greedy 0/1 agreement does not. A wrong slot
reading drops it most where the backbone carries the draft; a strong Markov head, which reads
only the previous token, holds part of it up under any reading (reported apart: `c1_backbone`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from dsparkctl.evaluation.teacher_forced import evaluate_sequences
from dsparkctl.math.sampling import SamplingParams
from dsparkctl.models.draft import DSparkDraft
from dsparkctl.models.draft_config import DraftConfig

SHIFTS = (0, -1, 1)
PARAMS = SamplingParams(1.0)  # β = Σ min(p, q): exact and continuous (see the module doc)
MIN_GAIN = 0.01  # c₁ by which another reading must beat the file's, on average over prompts, to be named
MIN_T = 3.0  # and by this many standard errors of the paired per-prompt differences


@dataclass(frozen=True)
class Reading:
    sample_from_anchor: bool
    layer_shift: int  # added to every canonical layer id

    def label(self) -> str:
        shift = "as read" if not self.layer_shift else f"{self.layer_shift:+d}"
        return f"sample_from_anchor={str(self.sample_from_anchor).lower()}, layer ids {shift}"


def readings(cfg: DraftConfig, num_layers: int) -> list[Reading]:
    """The file's own reading first, then every other one the target can hold."""
    out = []
    for anchor in (cfg.sample_from_anchor, not cfg.sample_from_anchor):
        for shift in SHIFTS:
            ids = [i + shift for i in cfg.target_layer_ids]
            if min(ids) < -1 or max(ids) > num_layers - 2 or (not anchor and cfg.block_size < 2):
                continue
            out.append(Reading(anchor, shift))
    return out


@contextlib.contextmanager
def read_as(draft: DSparkDraft, reading: Reading) -> Iterator[DSparkDraft]:
    """The same weights under another reading (the draft's forward reads its conventions from cfg)."""
    cfg = draft.cfg
    draft.cfg = cfg.replace(sample_from_anchor=reading.sample_from_anchor,
                            target_layer_ids=tuple(i + reading.layer_shift for i in cfg.target_layer_ids))
    try:
        yield draft
    finally:
        draft.cfg = cfg


def probe(draft: DSparkDraft, model: Any, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
          num_layers: int, batch_size: int = 8) -> dict[str, Any]:
    """c₁ and τ (teacher-forced, temperature 1) under every reading, and the verdict."""
    rows, per_prompt = [], []
    for r in readings(draft.cfg, num_layers):
        with read_as(draft, r) as d:
            stats = evaluate_sequences(d, model, seqs, prompt_lens, PARAMS, batch_size)
            backbone = _without_markov(d, model, seqs, prompt_lens, batch_size)
        c, cb = stats.conditional(), backbone.conditional()
        per_prompt.append(np.array([s[0] / n for s, n in zip(stats.sums, stats.counts)]))
        rows.append({"reading": r.label(), "sample_from_anchor": r.sample_from_anchor, "layer_shift": r.layer_shift,
                     "as_declared": r.layer_shift == 0 and r.sample_from_anchor == draft.cfg.sample_from_anchor,
                     "c1": c[0] if c else None, "c1_backbone": cb[0] if cb else None, "tau": stats.tau,
                     "anchors": stats.anchors})
    best_i = max(range(len(rows)), key=lambda i: rows[i]["c1"] if rows[i]["c1"] is not None else -1.0)
    gain, t = _paired(per_prompt[best_i], per_prompt[0]) if best_i else (0.0, 0.0)
    fits = not (gain >= MIN_GAIN and t >= MIN_T)
    return {"prompts": len(seqs), "readings": rows, "declared": rows[0]["reading"], "best": rows[best_i]["reading"],
            "gain_c1": gain, "t": t, "declared_fits": fits,
            "rule": f"another reading is named when its c1 beats the file's by >= {MIN_GAIN:.2f} on average over "
                    f"prompts and by >= {MIN_T:g} standard errors of the paired differences"}


def _paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of a − b over prompts and its t statistic (inf when every prompt agrees exactly)."""
    if len(a) != len(b) or not len(a):
        return 0.0, 0.0
    d = a - b
    if len(d) < 2:
        return float(d.mean()), 0.0
    se = float(d.std(ddof=1)) / math.sqrt(len(d))
    return float(d.mean()), (float(d.mean()) / se if se > 0 else (math.inf if d.mean() > 0 else 0.0))


def _without_markov(draft: DSparkDraft, model: Any, seqs: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                    batch_size: int) -> Any:
    """The backbone's own figures (no Markov bias): the part the conventions decide."""
    markov, conf = draft.markov_head, draft.confidence_head
    draft.markov_head = draft.confidence_head = None
    try:
        return evaluate_sequences(draft, model, seqs, prompt_lens, PARAMS, batch_size)
    finally:
        draft.markov_head, draft.confidence_head = markov, conf
