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
