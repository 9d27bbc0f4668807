"""The PNG of `placement report --plot`: each step's time stacked into data wait, comm, CPU
stall and compute, one panel per rank, with bind/tune/rollback/straggler events marked."""
from __future__ import annotations

import bisect
from typing import Optional

from placement.records.parts import record_parts
from placement.report.logs import LogReadError, RunLog, as_list

SEGMENTS = (("data wait", "#4C72B0"), ("comm", "#DD8452"), ("CPU stall", "#C44E52"), ("compute", "#8DA0CB"))
MARKS = {"bind": ("#555555", ":"), "tune": ("#2CA02C", "--"), "rollback": ("#D62728", "--"),
         "straggler": ("#9467BD", "-")}


def _step_at(times: list[float], steps: list[int], t: float) -> Optional[int]:
    if not times:
        return None
    i = min(bisect.bisect_left(times, t), len(times) - 1)
    return steps[i]


def pyplot():
    """matplotlib.pyplot on the Agg backend: files only, no display (imported when a PNG is
    asked for: the text report needs none of it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, out_path: str, dpi: int, what: str) -> None:
    """Write `fig` and close it; a path that cannot be written is LogReadError's one line."""
    try:
        fig.savefig(out_path, dpi=dpi)
    except OSError as e:
        raise LogReadError(f"cannot write the {what} {out_path!r}: {e.strerror or e}") from None
    finally:
        pyplot().close(fig)


def write_plot(log: RunLog, out_path: str) -> None:
    plt = pyplot()
    records = log.records or {}
    ranks = sorted(r for r, recs in records.items() if recs)
    if not ranks:
        raise LogReadError("no step records to plot")
    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 2.6 * len(ranks) + 0.8), sharex=True, squeeze=False)
    for ax, rank in zip(axes[:, 0], ranks):
        recs = records[rank]
        x = [r.step - (r.steps - 1) / 2 for r in recs]  # a record of several steps: their middle, per-step means
        parts = [record_parts(r) for r in recs]  # disjoint: the stack is the step
        data = [p.data_ms for p in parts]
        comm = [p.comm_ms for p in parts]
        stall = [p.cpu_stall_ms or 0.0 for p in parts]
        compute = [p.compute_ms for p in parts]
        ax.stackplot(x, data, comm, stall, compute, labels=[s[0] for s in SEGMENTS],
                     colors=[s[1] for s in SEGMENTS], step="mid", linewidth=0)
        ax.set_ylabel(f"rank {rank}\nms / step")
        ax.margins(x=0)
        times = [r.t for r in recs]
        marked, labelled = set(), set()
        for e in log.events:
            kind = e.get("type")
            if kind not in MARKS or not isinstance(e.get("t"), (int, float)):
                continue
            if kind != "straggler" and e.get("rank") != rank:
                continue
            if kind == "straggler":
                named = {r for s in as_list(e.get("stragglers")) if isinstance(s, dict) for r in as_list(s.get("ranks"))}
                span = as_list(e.get("steps"))
                if rank in named and len(span) == 2:  # the window it judged, not when it was written
                    ax.axvspan(span[0] - 0.5, span[1] + 0.5, color=MARKS[kind][0], alpha=0.12,
                               label=None if kind in labelled else "straggler window")
                    labelled.add(kind)
                continue
            step = _step_at(times, x, e["t"])
            if step is None or (kind, step) in marked:
                continue
            marked.add((kind, step))
            color, style = MARKS[kind]
            ax.axvline(step, color=color, linestyle=style, linewidth=1.2, label=None if kind in labelled else kind)
            labelled.add(kind)
    axes[-1, 0].set_xlabel("step")
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    fig.suptitle("placement: where each step's time went (data wait, comm wait, CPU stall, compute: disjoint, "
                 "adding up to the step)",
                 fontsize=10, y=0.995)
    top = 1 - 0.75 / fig.get_figheight()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, top + 0.02), ncol=min(len(labels), 8),
               frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, top - 0.02))
    save_png(fig, out_path, 110, "plot")
