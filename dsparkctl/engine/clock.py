"""Honest timing: synchronise the device before every clock read."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Accumulates named wall-clock spans (milliseconds) with device synchronisation."""

    def __init__(self, device: torch.device | str | None):
        self.device = device
        self.totals: dict[str, float] = {}
        self._t = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t = time.perf_counter()

    def lap(self, name: str) -> float:
        """Milliseconds since the last start/lap, added to `name`."""
        sync(self.device)
        now = time.perf_counter()
        ms = (now - self._t) * 1000.0
        self._t = now
        self.totals[name] = self.totals.get(name, 0.0) + ms
        return ms
