"""Live metrics for Prometheus: what each rank's monitor knows, exported per node by the placerun
agent (or per rank without placerun) as a `/metrics` endpoint and/or a node_exporter textfile.

names.py is every metric (name, unit, help); state.py a rank's figures and the snapshot it hands
the agent; render.py snapshots as Prometheus families; exporter.py the endpoint and textfile;
rank.py a rank's side (fed by its monitor and its event log). docs/monitor.md, live metrics.
"""
from placement.metrics.names import FAMILIES, Family
from placement.metrics.state import RankMetrics

__all__ = ["FAMILIES", "Family", "RankMetrics"]
