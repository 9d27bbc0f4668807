"""The heatmap PNG of `placement report --heatmap`: ranks (rows, grouped by node) x windows of
steps (columns), left coloured by each rank's mean step time against the job's median in
that window, right by CPU stall (main + NCCL runqueue wait, % of the step). Straggler
windows rank 0 named are outlined per kind; a hung rank is crossed at its last step.
Computed on columns (numpy bincount), so a million step records take well under a second.
"""
from __future__ import annotations

import math

from placement.report.cluster import job_wide, named_costs, stalled_ranks, straggler_ranks
from placement.report.logs import LogReadError, RunLog, as_list
from placement.report.plot import pyplot, save_png

MAX_COLUMNS = 200  # windows across; longer runs put several steps in a window
COST_LABELS = 200  # straggler windows labelled with their cost (more would be unreadable)
KIND_COLOURS = {"cpu-slow": "#D62728", "data-slow": "#1F77B4", "compute-slow": "#FF7F0E", "comm-slow": "#7F7F7F"}


def heat_grid(table: RunLog, max_columns: int = MAX_COLUMNS):
    """(ranks in row order, first step, steps per column, step-time ratio grid, CPU stall % grid);
    grids are rows x columns with NaN where a rank has no step in the window."""
    import numpy as np

    node_index = {node: i for i, node in enumerate(table.nodes())}
    order = sorted(table.ranks(), key=lambda r: (node_index.get(table.node.get(r), 1 << 30), r))
    first, last = int(table.step.min()), int(table.step.max())
    width = max(1, math.ceil((last - first + 1) / max_columns))
    columns = (last - first) // width + 1
    row_of = np.full(int(table.rank.max()) + 1, -1, dtype=np.int64)
    row_of[np.asarray(order)] = np.arange(len(order))
    cell = row_of[table.rank] * columns + (table.step - first) // width
    n = len(order) * columns
    count = np.bincount(cell, minlength=n).astype(np.float64)
    step_sum = np.bincount(cell, weights=table.step_ms, minlength=n)
    stall = table.stall_ms
    known = np.isfinite(stall)
    stall_sum = np.bincount(cell[known], weights=stall[known], minlength=n)
    step_known = np.bincount(cell[known], weights=table.step_ms[known], minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (step_sum / count).reshape(len(order), columns)
        median = np.nanmedian(np.where(np.isfinite(mean), mean, np.nan), axis=0)
        ratio = mean / median[None, :]
        stall_pct = (100.0 * stall_sum / step_known).reshape(len(order), columns)
    return order, first, width, ratio, stall_pct


def write_heatmap(table: RunLog, out_path: str) -> None:
    if not len(table):
        raise LogReadError("no step records to draw a heatmap of")
    import warnings

    import numpy as np
    from matplotlib.colors import LogNorm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows (a rank that stopped)
        order, first, width, ratio, stall_pct = heat_grid(table)
    plt = pyplot()
    rows, columns = ratio.shape
    row_of = {r: i for i, r in enumerate(order)}
    height = min(14.0, 3.0 + rows * 0.12)
    fig, axes = plt.subplots(1, 2, figsize=(15, height), sharey=True, squeeze=True)
    extent = (first - 0.5, first + columns * width - 0.5, rows - 0.5, -0.5)
    finite = ratio[np.isfinite(ratio)]
    spread = max(1.25, float(np.nanmax(finite)) if finite.size else 1.25)
    im0 = axes[0].imshow(ratio, aspect="auto", interpolation="nearest", extent=extent, cmap="RdBu_r",
                         norm=LogNorm(vmin=1 / spread, vmax=spread))
    fig.colorbar(im0, ax=axes[0], fraction=0.04, pad=0.01).set_label("step time / job median in the window")
    im1 = axes[1].imshow(stall_pct, aspect="auto", interpolation="nearest", extent=extent, cmap="Reds",
                         vmin=0, vmax=max(5.0, float(np.nanmax(stall_pct)) if np.isfinite(stall_pct).any() else 5.0))
    fig.colorbar(im1, ax=axes[1], fraction=0.04, pad=0.01).set_label("CPU stall, % of step")
    axes[0].set_title("step time vs the job's median", fontsize=10)
    axes[1].set_title("CPU stall (main's runqueue wait while computing: a part of the step)", fontsize=10)
    _marks(table, axes, row_of)
    _node_bands(table, axes, order)
    for ax in axes:
        ax.set_xlabel(f"step ({width} step(s) per column)" if width > 1 else "step")
    fig.suptitle(f"placement: {rows} rank(s) x {columns} window(s); outlines: straggler windows rank 0 named "
                 "(colour = kind, label = its cost, % of step); x: hung rank's last step", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    save_png(fig, out_path, 100, "heatmap")


def _marks(table: RunLog, axes, row_of: dict[int, int]) -> None:
    from matplotlib.patches import Rectangle

    labelled = set()
    labels = 0
    for e in table.events:
        kind = e.get("type")
        if kind == "straggler":
            span = as_list(e.get("steps"))
            if len(span) != 2:
                continue
            job = job_wide(e)
            if job is not None:  # every rank: the window, not the ranks
                k = "job-wide " + str(job.get("kind"))
                for ax in axes:
                    ax.axvspan(span[0] - 0.5, span[1] + 0.5, color=KIND_COLOURS["comm-slow"], alpha=0.25,
                               label=None if k in labelled or ax is not axes[0] else k)
                labelled.add(k)
            for k, ranks in straggler_ranks(e).items():
                colour = KIND_COLOURS.get(k, "black")
                if k == "comm-slow":
                    continue  # an older log's job-wide slowdown: drawn above
                costs = named_costs(e)
                for r in ranks:
                    if r not in row_of:
                        continue
                    for ax in axes:
                        ax.add_patch(Rectangle((span[0] - 0.5, row_of[r] - 0.5), span[1] - span[0] + 1, 1, fill=False,
                                               edgecolor=colour, linewidth=1.0,
                                               label=None if k in labelled or ax is not axes[0] else k))
                    if r in costs and labels < COST_LABELS:  # what it cost the job, % of step
                        axes[0].text(span[0], row_of[r], f"{costs[r]:.0f}%", fontsize=6, color=colour, va="center")
                        labels += 1
                    labelled.add(k)
        elif kind == "stall":
            step = e.get("last_step")
            for r in stalled_ranks(e):
                if r in row_of and isinstance(step, int):
                    for ax in axes:
                        ax.plot([step], [row_of[r]], marker="x", color="black", markersize=7, mew=2,
                                label=None if "stall" in labelled or ax is not axes[0] else "stall")
                    labelled.add("stall")
    if labelled:
        axes[0].legend(loc="lower left", fontsize=8, framealpha=0.8)


def _node_bands(table: RunLog, axes, order: list[int]) -> None:
    """Lines between nodes, node names (or rank numbers for a few ranks) on the y axis."""
    bounds, labels, ticks = [], [], []
    start = 0
    for i in range(1, len(order) + 1):
        if i == len(order) or table.node.get(order[i]) != table.node.get(order[start]):
            labels.append(table.node.get(order[start], "?"))
            ticks.append((start + i - 1) / 2)
            if i < len(order):
                bounds.append(i - 0.5)
            start = i
    for ax in axes:
        for b in bounds:
            ax.axhline(b, color="black", linewidth=0.6)
    if len(order) <= 40:
        axes[0].set_yticks(range(len(order)))
        axes[0].set_yticklabels([f"rank {r}" for r in order], fontsize=7)
        axes[0].set_ylabel(" | ".join(labels) if len(labels) <= 4 else "ranks by node")
    elif len(labels) <= 64:
        axes[0].set_yticks(ticks)
        axes[0].set_yticklabels(labels, fontsize=7)
        axes[0].set_ylabel("ranks, grouped by node")
    else:
        axes[0].set_ylabel("ranks, grouped by node (row = rank, in order)")
