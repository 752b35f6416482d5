"""Vocabulary surgery for engines without index maps: a reduced-vocabulary draft made full again."""

from __future__ import annotations

from typing import Any

import torch

from dsparkctl.errors import CheckpointError
from dsparkctl.models.draft import DSparkDraft


def expand_vocabulary(draft: Any, target: Any) -> Any:
    """A full-vocabulary copy of a reduced-vocabulary draft, for engines without index maps.

    Same backbone, W1 and heads; W2 gets zero rows outside the subset and the head is the
    target's full head again (borrowed from `target`, a TargetAdapter). Tokens outside the subset
    now get draft mass from the base logits, so its acceptance must be measured again."""
    if draft.draft_vocab_ids is None:
        return draft
    full = DSparkDraft(draft.cfg.replace(draft_vocab_size=0))
    skip = ("draft_vocab_ids", "lm_head.weight", "embed_tokens.weight", "markov_head.markov_w2.weight")
    res = full.load_state_dict({k: v for k, v in draft.state_dict().items() if k not in skip}, strict=False)
    expected = {k for k in skip if k in full.state_dict()}  # set below (W2, head) or borrowed from the target
    if res.unexpected_keys or set(res.missing_keys) - expected:
        raise CheckpointError(f"the full-vocabulary copy of {draft.cfg.kind} draft does not take its weights "
                              f"(missing {sorted(set(res.missing_keys) - expected)[:4]}, unexpected "
                              f"{sorted(res.unexpected_keys)[:4]})", "report this draft's config.json as a bug")
    if draft.markov_head is not None:
        w2 = full.markov_head.markov_w2.weight
        with torch.no_grad():
            w2.zero_()
            w2[draft.draft_vocab_ids] = draft.markov_head.markov_w2.weight.to(w2.dtype)
    full.share_target_embeddings(target.embed_tokens(), target.lm_head())
    p = next(draft.fc.parameters())
    return full.to(device=p.device, dtype=p.dtype).eval()
