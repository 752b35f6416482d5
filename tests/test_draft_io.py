"""Draft folders (models/draft_io.py): a hub id that cannot be reached says so (issue 20, class 6), not
"the repo has no config.json"; what save_draft writes (the umask honoured) and load_draft refuses."""

from __future__ import annotations

import os
import stat

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

from dsparkctl.errors import CheckpointError, InputError
from dsparkctl.models.draft_io import load_draft, random_draft, resolve_folder, save_draft
from dsparkctl.models.target import TargetAdapter
from tests.tiny_models import tiny_target


@pytest.mark.parametrize("exc,message", [
    (LocalEntryNotFoundError("offline"), "org/name: no such local folder, the hub cannot be reached and config.json is not in the local hub cache"),
    (EntryNotFoundError("404"), "org/name: the repo has no config.json"),
])
def test_unreachable_is_not_missing(monkeypatch, tmp_path, exc, message):
    monkeypatch.chdir(tmp_path)

    def fail(*a, **k):
        raise exc
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    with pytest.raises(InputError) as e:
        resolve_folder("org/name")
    assert message in e.value.one_line()


# -------- what save_draft writes and load_draft refuses
def test_int32_index_map_is_refused(tmp_path):
    adapter = TargetAdapter(tiny_target("llama", vocab=64, layers=4))
    draft = random_draft(adapter, num_layers=1, block_size=4, draft_vocab_size=16)
    out = save_draft(draft, tmp_path / "reduced")
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))
    sd["draft_vocab_ids"] = sd["draft_vocab_ids"].to(torch.int32)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="1-D int64"):
        load_draft(out, target=adapter)


def test_saved_draft_honours_the_umask(tmp_path):
    adapter = TargetAdapter(tiny_target("llama", vocab=64, layers=4))
    old = os.umask(0o022)
    try:
        ours = {"dsparkctl": {"note": "test"}}  # what marks a folder as ours, so it may be replaced
        out = save_draft(random_draft(adapter, num_layers=1, block_size=4), tmp_path / "d", extra_config=ours)
        first = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
        again = save_draft(random_draft(adapter, num_layers=1, block_size=4), out, overwrite=True,
                           extra_config=ours)
    finally:
        os.umask(old)
    assert first == {"model.safetensors": 0o644, "config.json": 0o644}
    for f in (again / "model.safetensors", again / "config.json"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
