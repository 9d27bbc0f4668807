"""Rank snapshots (state.py) as Prometheus metric families, per rank or summed per node.

What
    families(snapshots, per_rank) yields prometheus_client's CounterMetricFamily /
    GaugeMetricFamily / HistogramMetricFamily, named and documented by names.py. Per rank, every
    series carries the rank's labels (names.RANK_LABELS). Per node (placement.metrics.per_rank =
    false, for sites that cannot hold per-rank series at 16,384 ranks): counters and histograms
    summed over the node's ranks, `placement_last_step*` the node's oldest (the rank that lags),
    `placement_hung` the number of its ranks hung, residence the lowest; labels `run`, `node`.
    Straggler series come from rank 0's snapshot and name the straggler's rank and host.

Upstream
    prometheus_client's custom collectors (prometheus_client/metrics_core.py): a counter family's
    name is given without `_total`, which the text format adds; a histogram's buckets are
    cumulative and end with "+Inf".
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

from placement.metrics import names as n


def _cores():
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    return CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


def _family(f: n.Family, labels: tuple[str, ...]):
    counter, gauge, histogram = _cores()
    cls = {n.Kind.COUNTER: counter, n.Kind.GAUGE: gauge, n.Kind.HISTOGRAM: histogram}[f.kind]
    return cls(f.name, f.help, labels=list(labels + f.labels))


def _buckets(counts: list[int], steps: int) -> list[tuple[str, float]]:
    out, total = [], 0
    for edge, c in zip(n.STEP_BUCKETS, counts):
        total += c
        out.append((repr(edge), float(total)))
    out.append(("+Inf", float(steps)))
    return out


def families(snapshots: Iterable[dict[str, Any]], per_rank: bool = True) -> Iterator[Any]:
    snaps = list(snapshots)
    if not per_rank:
        snaps = list(_by_node(snaps))
    label_names = n.RANK_LABELS if per_rank else n.NODE_LABELS
    fam = {f: _family(f, label_names) for f in n.FAMILIES if f not in (n.STRAGGLERS, n.STRAGGLER_COST, n.BINDING)}
    seconds = {n.STEP_SECONDS: "step", n.DATA_WAIT: "data", n.COMM_WAIT: "comm", n.CPU_STALL: "cpu_stall",
               n.COMPUTE: "compute", n.OWN_CPU: "own_cpu"}
    for s in snaps:
        lv = [str(s["labels"].get(k, "")) for k in label_names]
        fam[n.STEPS].add_metric(lv, s["steps"])
        for f, key in seconds.items():
            fam[f].add_metric(lv, s["seconds"].get(key, 0.0))  # (own_cpu: not in a snapshot of an older rank)
        fam[n.STEP_DURATION].add_metric(lv, buckets=_buckets(s["buckets"], s["steps"]), sum_value=s["seconds"]["step"])
        if s["last_step_t"] is not None:
            fam[n.LAST_STEP_TIME].add_metric(lv, s["last_step_t"])
        fam[n.LAST_STEP].add_metric(lv, s["last_step"])
        for hangs, hung in ((n.HANGS, n.HUNG), (n.STALLS, n.STALLED)):  # (the old names for a release)
            fam[hangs].add_metric(lv, s["stalls"])
            fam[hung].add_metric(lv, s["stalled"])
        fam[n.DRIFT].add_metric(lv, s["drift"])
        for outcome, count in s["tuner"].items():
            fam[n.TUNER].add_metric(lv + [outcome], count)
        if s["residence"] is not None:
            fam[n.RESIDENCE].add_metric(lv, s["residence"])
    yield from fam.values()
    yield from _stragglers(snaps, per_rank)
    if per_rank:
        binding = _family(n.BINDING, label_names)
        for s in snaps:
            lv = [str(s["labels"].get(k, "")) for k in label_names]
            for role, (cpus, numa) in sorted(s["binding"].items()):
                binding.add_metric(lv + [role, cpus, numa], 1)
        yield binding


def _stragglers(snaps: list[dict[str, Any]], per_rank: bool) -> Iterator[Any]:
    labels = ("run", "rank", "node") if per_rank else ("run", "node")
    windows, cost = _family(n.STRAGGLERS, labels), _family(n.STRAGGLER_COST, labels)
    summed: dict[tuple, list[float]] = {}
    for s in snaps:
        run = str(s["labels"].get("run", ""))
        for rank, st in sorted(s.get("stragglers", {}).items(), key=lambda kv: int(kv[0])):
            base = (run, rank, st["node"]) if per_rank else (run, st["node"])
            for cause, count in st["windows"].items():
                got = summed.setdefault(base + (cause,), [0.0, 0.0])
                got[0] += count
                got[1] = max(got[1], st["cost"].get(cause, 0.0))
    for lv, (count, ratio) in sorted(summed.items()):
        windows.add_metric(list(lv), count)
        cost.add_metric(list(lv), ratio)
    yield windows
    yield cost


def _by_node(snaps: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each node's ranks as one snapshot (see the module docstring)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in snaps:
        groups.setdefault((str(s["labels"].get("run", "")), str(s["labels"].get("node", ""))), []).append(s)
    for (run, node), group in sorted(groups.items()):
        times = [g["last_step_t"] for g in group if g["last_step_t"] is not None]
        residence = [g["residence"] for g in group if g["residence"] is not None]
        tuner: dict[str, int] = {}
        for g in group:
            for k, v in g["tuner"].items():
                tuner[k] = tuner.get(k, 0) + v
        stragglers: dict[str, Any] = {}
        for g in group:
            stragglers.update(g.get("stragglers", {}))
        yield {"labels": {"run": run, "node": node}, "steps": sum(g["steps"] for g in group),
               "seconds": {k: sum(g["seconds"].get(k, 0.0) for g in group) for k in group[0]["seconds"]},
               "buckets": [sum(c) for c in zip(*(g["buckets"] for g in group))],
               "last_step": min(g["last_step"] for g in group), "last_step_t": min(times) if times else None,
               "stalls": sum(g["stalls"] for g in group), "stalled": sum(g["stalled"] for g in group),
               "drift": sum(g["drift"] for g in group), "tuner": tuner,
               "residence": min(residence) if residence else None, "binding": {}, "stragglers": stragglers}
