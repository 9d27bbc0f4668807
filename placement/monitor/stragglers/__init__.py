"""Which ranks hold the job back, and why: pure judgement of one exchange window's per-rank figures.

figures.py: the window row each rank sends (RankFigures), the thresholds, the report types;
cost.py: lateness step by step and what a late rank costs; classify.py: the kinds (data-, cpu-,
compute-slow, comm-slow job-wide); naming.py: which candidates are named, and when (precision);
event.py: a window's rows judged at any scale, and the `straggler` event and lines that say it.
No store, no thread, no clock: crossrank/ feeds the windows in and writes the events out."""
from placement.monitor.stragglers.classify import classify
from placement.monitor.stragglers.figures import RankFigures, StragglerReport, Thresholds
from placement.monitor.stragglers.naming import Naming

__all__ = ["Naming", "RankFigures", "StragglerReport", "Thresholds", "classify"]
