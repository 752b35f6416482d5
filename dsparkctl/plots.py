"""Figures for calibration and scheduler sweeps (matplotlib, Agg backend, atomic saves)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

from dsparkctl.errors import InputError, option
from dsparkctl.files.atomic import _writes, atomic_open
from dsparkctl.files.commit import recover
from dsparkctl.files.ownership import MARK, replace_refusal


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, imported on first use (a second of start-up that
    commands which draw nothing, and `--help`, do not pay)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reliability_diagram(before: dict[str, Any], after: dict[str, Any], temperature: float,
                        path: str | os.PathLike, as_path: str | os.PathLike | None = None) -> None:
    """One position: predicted survival vs observed survival rate per bin, before and after STS."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    ax.plot([0, 1], [0, 1], color="0.6", ls="--", lw=1, label="perfect calibration")
    for m, style, name in ((before, "o-", "raw"), (after, "s-", f"STS (T={temperature:.3g})")):
        d = m["diagram"]
        pts = [(p, f, c) for p, f, c in zip(d["mean_pred"], d["frac_pos"], d["count"]) if c > 0]
        if pts:
            ax.plot([p for p, _, _ in pts], [f for _, f, _ in pts], style, ms=4,
                    label=f"{name}: ECE {100 * m['ece']:.2f}%")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel(f"predicted survival â_{before['position']} (mean per bin)")
    ax.set_ylabel(f"observed rate: first {before['position']} drafts accepted")
    ax.set_title(f"Reliability, position {before['position']} (held-out n={before['n']}, {before['bins']} bins)")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    try:
        save_figure(fig, path, as_path=as_path)
    finally:
        plt.close(fig)


def reliability_paths(out_dir: str | os.PathLike, positions: int) -> list[Path]:
    """The PNG names `reliability_diagrams` writes for `positions` positions; every one checked
    first: a user's file among them stops the command before any is drawn."""

    paths = [Path(out_dir) / f"reliability_pos{k}.png" for k in range(1, positions + 1)]
    recover(out_dir)  # a run killed during its commit there: finished or undone before we judge
    for p in paths:
        why = replace_refusal(p)
        if why:
            raise InputError(f"{p} {why}; refusing to replace it",
                             f"choose another {option('plot_dir')}, or remove it yourself")
    return paths


def reliability_diagrams(result: dict[str, Any], out_dir: str | os.PathLike,
                         stage: Callable[[Path], Path] | None = None) -> list[str]:
    """One PNG per position in `out_dir`; with `stage` (files.atomic.staged) each is written to its
    staging name, so all appear together or none."""
    rows = list(zip(result["metrics_heldout"]["before"], result["metrics_heldout"]["after"], result["temperatures"]))
    paths = reliability_paths(out_dir, len(rows))
    for (b, a, t), p in zip(rows, paths):
        reliability_diagram(b, a, t, stage(p) if stage else p, as_path=p)
    return [str(p) for p in paths]


def frontier_plot(rows: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "",
                  as_path: str | os.PathLike | None = None) -> None:
    """Throughput (all users) vs per-user speed, one line per policy across concurrency levels
    (`as_path`: the figure's final name when `path` stages it, `files.atomic.staged`)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 6))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    markers = "osD^v<>ph*"
    for i, pol in enumerate(policies):
        pts = sorted((r["concurrency"], r["per_user_tok_s"], r["throughput_tok_s"]) for r in rows if r["policy"] == pol)
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker=markers[i % len(markers)], ms=4, lw=1.5, label=pol)
        if i == len(policies) - 1:
            for c, x, y in pts:
                ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color="0.35")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("per-user speed (tokens/s per request)")
    ax.set_ylabel("throughput Θ (tokens/s, all requests)")
    ax.set_title(title or "Scheduler frontier: throughput vs per-user speed (labels: concurrency C)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="policy", fontsize=8)
    save_figure(fig, path, as_path=as_path)
    plt.close(fig)


def plot_sps(bt: Sequence[int], sps: Sequence[float], path: str | os.PathLike, title: str,
             other: tuple[Sequence[int], Sequence[float], str] | None = None, label: str = "steps/s",
             as_path: str | os.PathLike | None = None) -> None:
    """An SPS table: steps/s (and ms/step) against batch tokens; `other` adds a second curve
    (batch tokens, steps/s, label), e.g. whole step against target forward (`as_path`: the
    figure's final name when `path` stages it)."""
    plt = pyplot()
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(bt, sps, "o-", color="tab:blue", label=label)
    if other is not None:
        ax1.plot(other[0], other[1], "^-", color="tab:green", label=other[2])
        ax1.legend(loc="upper right", fontsize=8)
    ax1.set_xlabel("batch tokens B (requests × tokens per request)")
    ax1.set_ylabel("steps per second", color="tab:blue")
    ax1.set_xscale("log", base=2)
    ax2 = ax1.twinx()
    ax2.plot(bt, [1000.0 / s for s in sps], "s--", color="tab:red", label="ms/step")
    ax2.set_ylabel("ms per step", color="tab:red")
    ax1.set_title(title)
    ax1.grid(True, alpha=0.3)
    save_figure(fig, path, as_path=as_path)
    plt.close(fig)


FIGURE_MARK = {"png": {"Software": MARK}, "pdf": {"Creator": MARK}, "svg": {"Creator": MARK},
               "ps": {"Creator": MARK}, "eps": {"Creator": MARK}}


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120, as_path: str | os.PathLike | None = None) -> None:
    """Atomically save a matplotlib figure (format from the suffix), marked as ours where the
    format has a place for it. An existing file at `path` is replaced only if we wrote it
    (`replace_refusal`); `as_path` is the name the figure will finally have (when `path` is a
    staging name, see `staged`). Under torchrun on rank 0 alone."""

    if not _writes():
        return
    path = Path(path)
    final = Path(as_path) if as_path is not None else path
    why = replace_refusal(final)
    if why:
        raise InputError(f"{final} {why}; refusing to replace it", "choose a new path, or remove it yourself")
    fmt = final.suffix.lower().lstrip(".") or "png"
    with atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=fmt, dpi=dpi, bbox_inches="tight", metadata=FIGURE_MARK.get(fmt))
