"""A hub id that cannot be reached says so (issue 20, class 6), not "the repo has no config.json"."""

from __future__ import annotations

import huggingface_hub
import pytest
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

from dsparkctl.errors import InputError
from dsparkctl.models.draft_io import resolve_folder


@pytest.mark.parametrize("exc,message", [
    (LocalEntryNotFoundError("offline"), "org/name: cannot reach the hub, and config.json is not in the local hub cache"),
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
