"""`placement report`: the monitor's JSONL logs read after the run (logs.py, the one reader)
and the views of them: the per-rank table and events (text.py), the cluster summary
(cluster.py), the stacked plot (plot.py), the heatmap (heatmap.py) and the Chrome trace
(trace.py). What it knows of the log's schema comes from placement/records/ (the step record,
the parts of a step and CPU stall's definition, digests, summaries, the words events carry);
it imports nothing of the live monitor."""
