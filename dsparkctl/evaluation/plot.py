"""Figure-2-style plot: conditional acceptance and survival vs position, one line per draft
(solid = live, dashed = teacher-forced), one column per dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsparkctl.plots import pyplot, save_figure


def plot_acceptance(results: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """results: {"datasets": {name: {"drafts": {label: {"teacher_forced": {...}, "live": {...}}}}}}."""
    plt = pyplot()
    datasets = list(results["datasets"])
    fig, axes = plt.subplots(2, len(datasets), figsize=(4.8 * len(datasets), 7), squeeze=False, sharey="row")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, ds in enumerate(datasets):
        drafts = results["datasets"][ds]["drafts"]
        gamma = max((r["block_size"] for r in drafts.values()), default=1)
        for i, (label, r) in enumerate(drafts.items()):
            c = colors[i % len(colors)]
            for mode, style in (("live", "-"), ("teacher_forced", "--")):
                m = r.get(mode)
                if not m:
                    continue
                for row, key in enumerate(("conditional", "survival")):
                    vals = m[key]
                    xs = [j + 1 for j, v in enumerate(vals) if v is not None]
                    ys = [v for v in vals if v is not None]
                    ivs = [m[f"{key}_interval"][j - 1] for j in xs]
                    ax = axes[row][col]
                    name = f"{label} ({'live' if mode == 'live' else 'TF'}, τ={m['tau']:.2f})"
                    ax.plot(xs, ys, style, marker="o", color=c, label=name)
                    if all(iv is not None for iv in ivs):
                        ax.fill_between(xs, [iv[0] for iv in ivs], [iv[1] for iv in ivs], color=c, alpha=0.12)
        axes[0][col].set_title(ds)
        axes[0][col].set_ylabel("conditional acceptance c_j")
        axes[1][col].set_ylabel("survival a_j")
        for row in range(2):
            axes[row][col].set_xlabel("position j")
            axes[row][col].set_xticks(range(1, gamma + 1))
            axes[row][col].set_xlim(0.8, gamma + 0.2)
            axes[row][col].set_ylim(0, 1.02)
            axes[row][col].grid(alpha=0.3)
        axes[0][col].legend(fontsize=7, loc="lower left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return Path(path)
