"""The training data cache is untrusted input (issue 20, class 3): prompts.json and every part
are validated when read back (`data.read_items`, `data.check_part`); a damaged file is discarded
with a note and rebuilt, giving the same sequences; something that is not a regular file there is
refused in one line naming it."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsparkctl.errors import InputError
from dsparkctl.train.data import build_dataset, data_dir
from dsparkctl.train.recipe import load_recipe
from tests.helpers import write_tiny_prompts
from tests.tiny_models import save_tiny_target


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("data")
    target = save_tiny_target(d / "target", "llama")
    prompts = write_tiny_prompts(d / "p.txt", last=30)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(target)
    rec = load_recipe(None, [f'target.model="{target}"', f'data.dataset="{prompts}"', "num_prompts=6",
                             "max_new_tokens=6", "data.batch_size=4", "layer_ids=[0, 2]", "data.topk=4",
                             "data.temperature=0.0", "eval.holdout=1"])
    return model, tok, rec


def _seqs(setup, cache, logs=None):
    model, tok, rec = setup
    return build_dataset(rec, model, tok, [1], cache, log=(logs.append if logs is not None else lambda m: None))


def _edit(path, fn):
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def _feats(folder):
    (f,) = sorted(folder.glob("feats_00000.*"))
    return f


CASES = [
    ("prompts.json truncated", lambda f: (f / "prompts.json").write_text('[{"prompt": [1, 2'), "prompts.json"),
    ("prompts.json an object", lambda f: (f / "prompts.json").write_text('{"data": 5}'), "prompts.json"),
    ("prompts.json ids out of range", lambda f: (f / "prompts.json").write_text('[{"prompt": [99999]}]'),
     "prompts.json"),
    ("prompts.json floats", lambda f: (f / "prompts.json").write_text('[{"prompt": [1.5]}]'), "prompts.json"),
    ("feature part truncated", lambda f: _feats(f).write_bytes(_feats(f).read_bytes()[:300]), "feats_00000"),
    ("feature part wrong shape", lambda f: _edit(_feats(f), lambda t: t.update(features=t["features"][:-1])),
     "feats_00000"),
    ("feature part NaN", lambda f: _edit(_feats(f), lambda t: t["features"].fill_(float("nan"))), "feats_00000"),
    ("top-k ids out of range", lambda f: _edit(_feats(f), lambda t: t["topk_ids"].fill_(10 ** 6)), "feats_00000"),
    ("token part truncated", lambda f: (f / "tokens_00000.safetensors").write_bytes(
        (f / "tokens_00000.safetensors").read_bytes()[:100]), "tokens_00000"),
    ("token part other prompts", lambda f: _edit(f / "tokens_00000.safetensors",
                                                 lambda t: t["tokens"].copy_(t["tokens"].flip(0))), "tokens_00000"),
    ("token ids out of range", lambda f: _edit(f / "tokens_00000.safetensors",
                                               lambda t: t["tokens"].fill_(-3)), "tokens_00000"),
]


@pytest.mark.parametrize("case,damage,file", CASES, ids=[c[0] for c in CASES])
def test_a_damaged_cache_file_is_rebuilt_with_a_note(setup, tmp_path, case, damage, file):
    first = _seqs(setup, tmp_path)
    folder = data_dir(setup[2], tmp_path)
    names = sorted(p.name for p in folder.iterdir())
    damage(folder)
    logs: list[str] = []
    again = _seqs(setup, tmp_path, logs)
    assert len(again) == len(first)
    for a, b in zip(first, again):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.topk_ids, b.topk_ids)
        torch.testing.assert_close(a.features, b.features)
    assert len(logs) == 1 and logs[0].startswith("note: the data cache's") and file in logs[0], logs
    assert sorted(p.name for p in folder.iterdir()) == names
    assert _seqs(setup, tmp_path, logs) and len(logs) == 1  # valid again: no further note


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_something_else_in_the_cache_is_refused_naming_it(setup, tmp_path, kind):
    _seqs(setup, tmp_path)
    f = _feats(data_dir(setup[2], tmp_path))
    f.unlink()
    f.mkdir() if kind == "folder" else os.mkfifo(f)
    with pytest.raises(InputError) as e:
        _seqs(setup, tmp_path)
    assert str(f) in e.value.one_line() and "is not a regular file" in e.value.one_line()


def test_extra_answers_come_from_their_own_dataset_and_share_its_cache(setup, tmp_path):
    """data.extra_dataset: the regenerated prompts come from data.dataset, the teacher-forced extras
    from another file (its answers, its own cache: the one a recipe training on them would use)."""
    import dataclasses
    import json

    from dsparkctl.train.data import extra_recipe

    model, tok, rec = setup
    answers = tmp_path / "answers.jsonl"
    rows = [{"question": f"w{i} w{i + 1}", "response": f"w{i + 2} w{i + 3}"} for i in range(40, 60, 2)]
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixed = dataclasses.replace(rec, data=dataclasses.replace(rec.data, extra_responses=3, extra_dataset=str(answers),
                                                              response_field="response"))
    seqs = build_dataset(mixed, model, tok, [1], tmp_path, log=lambda m: None)
    own = _seqs(setup, tmp_path)
    assert len(seqs) == len(own) + 3
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(seqs, own))
    pairs = {(r["question"], r["response"]) for r in rows}
    for s in seqs[len(own):]:
        prompt, answer = tok.decode(s.tokens[: s.prompt_len]), tok.decode(s.tokens[s.prompt_len:]).strip()
        assert any(q in prompt and answer.startswith(a) for q, a in pairs), (prompt, answer)
    other = extra_recipe(mixed)
    assert (other.data.dataset, other.data.source, other.data.field) == (str(answers), "responses", None)
    assert data_dir(other, tmp_path).is_dir()
    with pytest.raises(InputError, match="extra_dataset"):
        load_recipe(None, [f'data.extra_dataset="{answers}"'])
    with pytest.raises(InputError, match="extra_dataset is empty"):
        load_recipe(None, ['data.extra_dataset=" "', "data.extra_responses=3"])


@pytest.mark.parametrize("bad", ["missing.jsonl", "no-answers.jsonl"])
def test_a_bad_extra_dataset_fails_before_any_answer_is_regenerated(setup, tmp_path, bad):
    import dataclasses

    model, tok, rec = setup
    (tmp_path / "no-answers.jsonl").write_text('{"question": "w40 w41"}\n')
    mixed = dataclasses.replace(rec, data=dataclasses.replace(rec.data, extra_responses=3,
                                                              extra_dataset=str(tmp_path / bad),
                                                              response_field="response"))
    with pytest.raises(InputError) as e:
        build_dataset(mixed, model, tok, [1], tmp_path / "cache", log=lambda m: None)
    assert bad in e.value.one_line()
    assert not list((tmp_path / "cache").rglob("tokens_*"))  # nothing was regenerated


def test_prompt_filter_keeps_requests_for_prose_and_keys_its_own_cache(setup, tmp_path):
    """data.prompt_filter = "prose": only the prose requests of data.dataset are regenerated; the
    cache is its own, and recipes without a filter keep the keys their caches already have."""
    import dataclasses

    from dsparkctl.train.data import candidate_items

    model, tok, rec = setup
    prose = [" ".join(f"w{j}" for j in range(i, i + 7)) for i in range(3, 30, 3)]  # 20+ characters
    code = ["def w3(w4): return w5", "w6 = w7 + w8;", "```w9 w10```", "w11 w12 in python please w13 w14"]
    f = tmp_path / "mixed.txt"
    f.write_text("\n".join(prose + code) + "\n")
    mixed = dataclasses.replace(rec, data=dataclasses.replace(rec.data, dataset=str(f)))
    only = dataclasses.replace(mixed, data=dataclasses.replace(mixed.data, prompt_filter="prose"))
    assert len(candidate_items(mixed, tok)) == len(prose) + len(code)
    kept = {tok.decode(it["prompt"]) for it in candidate_items(only, tok)}
    assert len(kept) == len(prose) and all(any(p in k for p in prose) for k in kept)
    assert data_dir(only, tmp_path) != data_dir(mixed, tmp_path)
    too_many = dataclasses.replace(only, data=dataclasses.replace(only.data, num_prompts=len(prose) + 1))
    with pytest.raises(InputError) as e:
        candidate_items(too_many, tok)
    assert "pass data.prompt_filter = 'prose'" in e.value.one_line() and "drop the filter" in e.value.one_line()
    seqs = build_dataset(only, model, tok, [1], tmp_path, log=lambda m: None)
    assert len(seqs) == only.data.num_prompts
    # the shipped stage-8 recipe's cache key, from before the key existed: unchanged
    stage8 = load_recipe("recipes/smollm2-135m-dspark-stage8.toml")
    assert stage8.data_digest() == "0c04337f4797"
    assert stage8.digest() == "59ca7ecc2f57"  # and its run folder
    with pytest.raises(InputError, match="prompt_filter"):
        load_recipe(None, ['data.prompt_filter="poetry"'])


@pytest.mark.parametrize("text,prose", [
    ("Write a persuasive essay on why cities should plant more trees.", True),
    ("Compose a short story about a lighthouse keeper \u2014 \u201cthe last one\u201d.", True),
    ("Explain photosynthesis.", True),
    ("continue", False),  # too short: a follow-up with nothing to answer
    ("Write a python function that reverses a list.", False),
    ("Fix this: for (i = 0; i < n; i++) {", False),
    ("What does <div class='x'> mean?", False),
    ("```\nprint(1)\n```", False),
    ("\u8bf7\u5199\u4e00\u7bc7\u5173\u4e8e\u6625\u5929\u7684\u6587\u7ae0\uff0c\u4e0d\u5c11\u4e8e\u4e09\u767e\u5b57\u3002", False),
    ("import numpy as np and tell me what it does", False),
])
def test_is_prose(text, prose):
    from dsparkctl.data.filters import is_prose

    assert is_prose(text) is prose
