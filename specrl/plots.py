"""Metric curves from metrics.jsonl histories, one panel per metric, one line per run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_metrics(
    histories: dict[str, list[dict[str, float]]],
    panels: Sequence[tuple[str, str]],
    path: Path,
    title: str | None = None,
) -> None:
    """One panel per (metric, title) that some history logs (a vanilla run logs no reused
    token ratio, say), one line per history, in the same colour in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in panels if any(p[0] in m for h in histories.values() for m in h)]
    columns = 2
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(11, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, panel_title) in zip(axes.flat, panels, strict=False):
        for number, (label, history) in enumerate(histories.items()):
            points = [(m["training/global_step"], m[key]) for m in history if key in m]
            if points:
                ax.plot(
                    *zip(*points, strict=True),
                    label=label,
                    color=colours[number % len(colours)],
                    marker="." if key.startswith("val/") else None,
                )
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        if len(histories) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
