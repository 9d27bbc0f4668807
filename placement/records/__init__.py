"""The monitor log's schema: what a rank writes and `placement report` reads back.

- step.py: StepRecord, one line per training step, and how it is encoded;
- parts.py: StepPart, the four disjoint parts of a step (data, comm, CPU stall, compute);
- verdict.py: each step's verdict word;
- digest.py: StepDigest, the sums of many steps (a long job's report reads these);
- summary.py: the periodic one-line summary;
- words.py: the words events carry (straggler kinds, a cost, which hung rank came first).
Nothing here runs inside the training loop's monitor thread alone: the report imports only this.
"""
from placement.records.parts import StepPart, split_step
from placement.records.step import StepRecord

__all__ = ["StepPart", "StepRecord", "split_step"]
