"""Per-step probes, comm timing, cross-rank straggler naming, sinks."""
