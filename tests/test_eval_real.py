"""The shipped draft on the real embedded SmolLM2 target (slow: loads the 135M model)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_shipped_draft_is_accepted_on_mt_bench():
    from dsparkctl.data.prompts import encode_prompts, load_prompts
    from dsparkctl.evaluation.acceptance import DraftUnderTest, evaluate_dataset
    from dsparkctl.math.sampling import SamplingParams
    from dsparkctl.models.draft_io import load_draft
    from dsparkctl.models.loading import default_draft_dir, load_target, stop_token_ids
    from dsparkctl.models.target import TargetAdapter

    shipped = default_draft_dir()
    assert shipped is not None, "the default draft must ship in dsparkctl/assets/drafts/"
    assert sum(f.stat().st_size for f in shipped.iterdir()) <= 40 * 2**20
    lt = load_target(None, torch.device("cpu"), torch.float32, log=lambda s: None)
    draft = load_draft(shipped, TargetAdapter(lt.model))
    assert "embed_tokens.weight" not in draft.state_dict() or draft.embed_tokens is lt.model.get_input_embeddings()
    prompts = encode_prompts(lt.tokenizer, load_prompts("mt-bench", limit=4))
    res = evaluate_dataset(lt.model, [DraftUnderTest("shipped", draft, str(shipped))], prompts, mode="both",
                           params=SamplingParams(0.0), max_new_tokens=32, stop_ids=stop_token_ids(lt.tokenizer, lt.model),
                           seed=0, batch_size=4)
    r = res["drafts"]["shipped"]
    assert r["live"]["tau"] > 1.1 and r["teacher_forced"]["tau"] > 1.1  # an untrained draft sits at ~1.0
