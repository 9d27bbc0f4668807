"""`placement report`: the monitor's JSONL logs read after the run (logs.py, the one reader)
and the views of them: the per-rank table and events (text.py), the cluster summary
(cluster.py), the stacked plot (plot.py), the heatmap (heatmap.py) and the Chrome trace
(trace.py). Shared with the live monitor, and imported from placement.monitor: the step
record (record.py), the run figures and the definition of CPU stall (summary.py), the
straggler kinds (straggler.py) and the stall ordering (stall.py)."""
