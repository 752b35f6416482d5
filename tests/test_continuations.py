"""Target continuations are computed once per (model, prompts, settings) and reused; the cache is untrusted
input (evaluation/continuations.py)."""

from __future__ import annotations

import json
import os

import pytest

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


# -------- the cache is untrusted input: every damaged entry is discarded and recomputed with a note (never a wrong
# τ, never an internal error, never a hang), and a cache that cannot be written is said before the work and never
# loses the result
G = SamplingParams(0.0)


def _damage(doc: dict, how: str) -> object:
    c = doc["continuations"]
    if how == "changed token":  # well-formed, in range: only the digest shows it
        c[0][0] = (c[0][0] + 1) % 64
    elif how == "token out of range":
        c[0][0] = 10 ** 9
    elif how == "negative token":
        c[0][0] = -1
    elif how == "float token":
        c[0][0] = 1.0
    elif how == "bool token":
        c[0][0] = True
    elif how == "too long":
        c[0] = c[0] + [1] * 50
    elif how == "missing prompt":
        del c[0]
    elif how == "not a list":
        doc["continuations"] = {"a": 1}
    elif how == "no digest":
        del doc["sha256"]
    elif how == "other key":
        doc["key"] = "0" * 24
    elif how == "a list document":
        return [doc]
    return doc


CASES = ["changed token", "token out of range", "negative token", "float token", "bool token", "too long",
         "missing prompt", "not a list", "no digest", "other key", "a list document"]


@pytest.mark.parametrize("how", CASES + ["truncated", "not utf-8", "NaN", "duplicate key"])
def test_a_damaged_entry_is_recomputed_with_a_note(tmp_path, monkeypatch, how):
    monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path))
    model = tiny_target("llama")
    first, hit = cached_continuations(model, PROMPTS, G, 8, [1])
    assert not hit
    (f,) = cache_dir().glob("*.json")
    text = f.read_text()
    if how == "truncated":
        f.write_text(text[: len(text) // 2])
    elif how == "not utf-8":
        f.write_bytes(b"\xff\xfe" + text.encode())
    elif how == "NaN":
        f.write_text(text.replace('"continuations": [[', '"x": NaN, "continuations": [[', 1))
    elif how == "duplicate key":
        f.write_text(text.replace('"continuations":', '"key": "a", "continuations":', 1))
    else:
        f.write_text(json.dumps(_damage(json.loads(text), how)))
    logs: list[str] = []
    again, hit = cached_continuations(model, PROMPTS, G, 8, [1], log=logs.append)
    assert not hit and again == first
    assert len(logs) == 1 and logs[0].startswith(f"note: the cached continuations {f}") and "recomputing" in logs[0]
    assert cached_continuations(model, PROMPTS, G, 8, [1]) == (first, True)  # rewritten, valid again
    assert [p.name for p in tmp_path.iterdir()] == [f.name]


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink"])
def test_something_else_at_an_entry_path_is_never_opened_nor_replaced(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path / "c"))
    model = tiny_target("llama")
    first, _ = cached_continuations(model, PROMPTS, G, 8, [1])
    (f,) = cache_dir().glob("*.json")
    f.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text("mine\n")
    {"fifo": lambda: os.mkfifo(f), "folder": f.mkdir, "symlink": lambda: f.symlink_to(target)}[kind]()
    logs: list[str] = []
    again, hit = cached_continuations(model, PROMPTS, G, 8, [1], log=logs.append)  # a FIFO would block here
    assert (again, hit) == (first, False)
    assert any("recomputing" in m for m in logs) and any("left as it is" in m for m in logs)
    assert target.read_text() == "mine\n" and os.path.lexists(f)


@pytest.mark.parametrize("kind", ["file", "read-only", "empty variable"])
def test_a_cache_that_cannot_be_written_is_said_first_and_the_result_kept(tmp_path, monkeypatch, kind):
    model = tiny_target("llama")
    if kind == "file":
        (tmp_path / "c").write_text("x")
        monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path / "c"))
    elif kind == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        (tmp_path / "c").mkdir(mode=0o500)
        monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path / "c"))
    else:  # an empty variable is unset: never the current folder
        monkeypatch.setenv("DSPARKCTL_CONTINUATIONS_CACHE", "")
        monkeypatch.setenv("DSPARKCTL_CACHE", "")
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        monkeypatch.chdir(tmp_path)
    logs: list[str] = []
    conts, hit = cached_continuations(model, PROMPTS, G, 8, [1], log=logs.append)
    assert not hit and len(conts) == len(PROMPTS)
    if kind == "empty variable":
        assert logs == [] and len(list((tmp_path / "home" / ".cache" / "dsparkctl" / "continuations").iterdir())) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]
    else:
        assert len(logs) == 1 and "cannot be cached" in logs[0]
