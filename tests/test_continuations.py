"""Target continuations are computed once per (model, prompts, settings) and reused."""

from __future__ import annotations

import json

from dsparkctl.evaluation.continuations import cache_dir, cached_continuations
from dsparkctl.evaluation.live import target_continuations
from dsparkctl.math.sampling import SamplingParams
from tests.tiny_models import tiny_target

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def test_cached_equals_fresh_and_keys_on_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path))
    model = tiny_target("qwen3")
    g = SamplingParams(0.0)
    first, hit = cached_continuations(model, PROMPTS, g, 10, [1])
    assert not hit and first == target_continuations(model, PROMPTS, g, 10, [1])
    again, hit = cached_continuations(model, PROMPTS, g, 10, [1])
    assert hit and again == first
    _, hit = cached_continuations(model, PROMPTS, g, 12, [1])  # another length: computed
    assert not hit
    _, hit = cached_continuations(model, PROMPTS, SamplingParams(1.0), 10, [1], seed=3)
    assert not hit
    other = tiny_target("qwen3", seed=5)  # other weights, same config: not the same answers
    _, hit = cached_continuations(other, PROMPTS, g, 10, [1])
    assert not hit


def test_a_corrupt_cache_file_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path))
    model = tiny_target("llama")
    first, _ = cached_continuations(model, PROMPTS, SamplingParams(0.0), 8, [1])
    (f,) = cache_dir().glob("*.json")
    doc = json.loads(f.read_text())
    doc["continuations"][0] = ["not", "ids"]
    f.write_text(json.dumps(doc))
    again, hit = cached_continuations(model, PROMPTS, SamplingParams(0.0), 8, [1])
    assert not hit and again == first
