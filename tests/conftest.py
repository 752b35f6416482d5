"""Tests never write into the user's caches (the embedded target's conversion is shared on purpose)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_continuations_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DSPARKCTL_CONTINUATIONS_CACHE", str(tmp_path_factory.mktemp("continuations")))
    mp.setenv("DSPARKCTL_CPU_KERNELS_CACHE", str(tmp_path_factory.mktemp("kernels") / "cpu_kernels.json"))
    mp.setenv("DSPARKCTL_SPS_CACHE", str(tmp_path_factory.mktemp("sps")))
    mp.setenv("DSPARKCTL_STATE", str(tmp_path_factory.mktemp("state")))  # the ledgers of what tests write
    yield
    mp.undo()


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    """A tiny qwen3 target folder and a DeepSpec draft folder for it: (target dir, draft dir)."""
    from tests.tiny_models import save_tiny_target, write_deepspec_draft

    root = tmp_path_factory.mktemp("models")
    target = save_tiny_target(root / "target", "qwen3", vocab=64, layers=4)
    draft = write_deepspec_draft(root / "draft", vocab=64, hidden=32, taps=(0, 1), rank=8, block_size=4)
    return target, draft
