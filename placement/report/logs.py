"""The one reader of monitor JSONL logs: every file named is read and parsed once, into the
step records as columns (every view of `placement report`) and, for a run of a few ranks, as
StepRecords too (the per-rank table and the plot), plus the events in time order.

Columns because `placement report` on a cluster reads a million steps (1,024 ranks x 1,000): as StepRecords,
gigabytes; as columns ~60 MB. A column per figure a view uses, a row per step (a line of several steps, records/step.py,
a row each): rank, step, end time, step/data/comm/CPU stall ms (records/parts.py), first-collective entry, verdict.
StepRecords are kept while the logs hold at most RANK_TABLE_MAX ranks.

Lines that are truncated (a killed process) or corrupt (not JSON, or a field the report
reads of the wrong type: valid_step, valid_event) are skipped and counted, never fatal; one
rule for the columns and the StepRecords, which come from the same reading. `lost` events (records the writer could not
write, e.g. a full disk) are totalled per rank. Runs: every record carries its run's id (`run`,
the same on every rank of the run: placement/identity.py), so logs that hold several runs (a
relaunch appending to the same files, or two jobs' directories named together) are read apart,
and one run is reported: the one that began last, or the one asked for (`run`: its number in
order of start, or its id). Within one run, a rank whose step number does not go up has started
over (a log written before run ids, or a launcher that reuses one): its earlier steps there are
dropped and counted.

A long job's logs are read by their digests (records/digest.py: every monitor.digest_every steps
a rank writes the sums and step-time histogram of its steps): every line but the step lines is
parsed, and the step lines are counted, not parsed (found by their first bytes, `{"type":"step"`,
in one pass of the regex engine). Chosen by `read`: STEPS, DIGESTS, or AUTO (digests when the logs
hold more than DIGESTS_FROM step lines by their size and have digests).

Which node a rank ran on: the `host` and `node_rank` of its monitor's `start` event
(node_rank = torch elastic's GROUP_RANK, which tells apart two agents on one host), else
the directory its log file sits in (logs gathered per node into a tree).
"""
from __future__ import annotations

import glob
import json
import os
import re
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional

from placement._procfs import read_bounded
from placement.errors import PlacementError
from placement.events import index_path
from placement.records.digest import StepDigest
from placement.records.step import StepRecord, is_integer, is_number, role_runq, valid_step
from placement.records.verdict import VERDICTS
from placement.records.parts import split_step
from placement.vocab import Vocabulary

LOG_MAX = 1 << 30  # one rank's log; a week of steps at 20 ms is ~15 MB
LINE_MAX = 1 << 20  # a line longer than this is no record of ours (a step line is ~300 bytes)
GZ_EXPAND_MAX = 64  # a rotated log expands at most this much (ours: ~10x, docs/monitor.md, log size) ...
GZ_FLOOR = 16 << 20  # ... or to this, whichever is more
RANK_TABLE_MAX = 32  # more ranks than this: per-node figures instead of a row (and a plot panel) per rank

_NAN = float("nan")
_VERDICT_CODE = {v: i for i, v in enumerate(VERDICTS)}
# Columns of figures (float64); rank, step and verdict are integer columns of their own.
FIGURES = ("t", "step_ms", "data_ms", "comm_ms", "stall_ms", "enter_t")


class LogReadError(PlacementError):
    """A log path given to `placement report` cannot be read at all."""


class ReadMode(Vocabulary):
    """What of the step records `placement report` reads (--read)."""

    AUTO = "auto"  # digests when the logs are long (DIGESTS_FROM) and have them, else every step line
    STEPS = "steps"  # every step line parsed: every view (--plot, --heatmap, --trace)
    DIGESTS = "digests"  # the digests alone: the tables and events, in a fraction of the time


# Step lines from which AUTO reads the digests: ~4 GB of logs, ~40 s of parsing on 2 cores here,
# ~1.3 GB of columns. Estimated from the files' sizes: STEP_LINE_BYTES a line as written (soak.py
# measures ~406), GZ_RATIO for a rotated log's compression (~9x).
DIGESTS_FROM = 10_000_000
STEP_LINE_BYTES = 400
GZ_RATIO = 9
# Every line but a step line (with its leading newline), found in C: the pattern begins with a
# literal, so the engine jumps from newline to newline (~1 GB/s here; `^...$` with re.M tries
# every byte, 3x slower).
_NOT_STEP_LINE = re.compile(rb'\n(?!\{"type":"step")[^\n]+')
_STEP_PREFIX = b'{"type":"step"'


@dataclass
class RunLog:
    """The logs read: step records as columns (numpy arrays of equal length, sorted by rank
    then step; NaN = unknown), the same records per rank as StepRecords when there are at
    most RANK_TABLE_MAX ranks (`records`, None beyond), and the events by time."""

    rank: Any
    step: Any
    t: Any  # wall clock at the end of the step (the rank's own host clock)
    step_ms: Any
    data_ms: Any
    comm_ms: Any
    stall_ms: Any
    enter_t: Any  # when the rank entered its first collective of the step
    verdict: Any  # index into records/verdict.py VERDICTS (-1: a verdict this version does not know)
    records: Optional[dict[int, list[StepRecord]]] = None  # rank -> records in step order
    node: dict[int, str] = field(default_factory=dict)  # every rank -> its node's label
    events: list[dict[str, Any]] = field(default_factory=list)  # everything but step records, by time
    files: list[str] = field(default_factory=list)
    skipped: int = 0  # lines that were not a readable record
    lost: dict[int, int] = field(default_factory=dict)  # rank -> records its writer could not write
    earlier_runs: dict[int, int] = field(default_factory=dict)  # rank -> runs dropped before the last
    runs: list["RunInfo"] = field(default_factory=list)  # every run the logs hold, in order of start
    run: Optional["RunInfo"] = None  # the run these columns and events are of
    # Read by digests (ReadMode): the columns and records are empty; each rank's digests merged.
    from_digests: bool = False
    digests: dict[int, StepDigest] = field(default_factory=dict)
    step_lines: int = 0  # step lines counted, not parsed (read by digests)
    indexed: int = 0  # logs read by their event index (events.index_path): their step lines not counted
    long_without_digests: bool = False  # AUTO found the logs long but with no digests: every line was parsed
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (file, why) skipped, the rest read
    links_skipped: int = 0  # links met in a directory walk, not followed
    # Step lines written before comm wait (records/parts.py): no comm_inflight_ms, and their
    # comm_ms, read as the comm part, is the collectives' time in flight.
    comm_in_flight: int = 0

    def __len__(self) -> int:
        return len(self.rank)

    def step_count(self) -> int:
        """Step records the report covers: the columns', or the digests' steps."""
        return sum(d.steps for d in self.digests.values()) if self.from_digests else len(self.rank)

    def ranks(self) -> list[int]:
        import numpy as np

        if self.from_digests:
            return sorted(self.digests)
        return [int(r) for r in np.unique(self.rank)]

    def nodes(self) -> list[str]:
        """Node labels in the order of their lowest rank."""
        seen: dict[str, int] = {}
        for rank, node in sorted(self.node.items()):
            seen.setdefault(node, rank)
        return list(seen)

    def rank_slices(self) -> dict[int, slice]:
        """rank -> the slice of the columns holding its records."""
        import numpy as np

        if not len(self.rank):
            return {}
        cut = np.flatnonzero(np.diff(self.rank)) + 1
        starts = np.concatenate(([0], cut))
        ends = np.concatenate((cut, [len(self.rank)]))
        return {int(self.rank[s]): slice(int(s), int(e)) for s, e in zip(starts, ends)}

    def t0(self) -> float:
        """When the run began: its first event or the start of its first step."""
        import numpy as np

        times = [e["t"] for e in self.events if isinstance(e.get("t"), (int, float))]
        if len(self.t):
            times.append(float(np.nanmin(self.t - self.step_ms / 1e3)))
        return min(times) if times else 0.0


NO_ID = ""  # the run of records written before runs had ids


@dataclass
class RunInfo:
    """One run the logs hold: its id, its job (the launcher's, from `start` events), when it
    began and ended (first and last record), its ranks and step records."""

    id: str
    number: int = 0  # 1-based, in order of start
    job: Optional[str] = None
    first_t: float = float("inf")
    last_t: float = float("-inf")
    ranks: set[int] = field(default_factory=set)
    records: int = 0

    def saw(self, t: Any) -> None:
        if is_number(t):
            self.first_t = min(self.first_t, t)
            self.last_t = max(self.last_t, t)

    def describe(self) -> str:
        from placement.cpuset import format_cpulist

        import time

        began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.first_t)) if self.first_t != float("inf") else "?"
        ranks = format_cpulist(sorted(self.ranks)) if self.ranks else "none"
        return (f"{self.number} {self.id or '(no id)'}" + (f" job {self.job}" if self.job else "")
                + f" began {began}, ranks {ranks}, {self.records} step records")


def expand(paths: list[str], links: Optional[list[str]] = None) -> list[str]:
    """Files named, the *.jsonl and rotated *.jsonl.gz files anywhere under directories named
    (one per node, gathered into a tree), and what glob patterns match (quoted, so the shell left
    them to us). A rotated log found both compressed and not (its compression was under way) is
    read once, uncompressed."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(_walk(p, links))
            if not found:
                raise LogReadError(f"{p!r} holds no *.jsonl file; give monitor logs, e.g. placement_logs/rank0.jsonl")
            out.extend(found)
        elif not os.path.exists(p) and glob.has_magic(p):
            found = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
            if not found:
                raise LogReadError(f"{p!r} matches no file; give monitor logs, e.g. 'logs/*/rank*.jsonl'")
            out.extend(found)
        else:
            out.append(p)
    listed = set(out)
    seen: set[tuple[int, int]] = set()
    files = []
    for f in dict.fromkeys(out):
        if f.endswith(".jsonl.gz") and f[:-3] in listed:
            continue
        try:
            st = os.stat(f)
            inode = (st.st_dev, st.st_ino)
        except OSError:
            files.append(f)  # said when it is read
            continue
        if inode not in seen:  # a file named twice (a link, a path given twice) is read once
            seen.add(inode)
            files.append(f)
    return files


def _walk(top: str, links: Optional[list[str]]):
    """The *.jsonl and *.jsonl.gz files under `top`, without following a link (a link to a
    directory could loop, `loop -> .`, or reach another user's files): links are left out, and
    added to `links`."""
    for root, dirs, names in os.walk(top, followlinks=False):
        for d in dirs:
            if links is not None and os.path.islink(os.path.join(root, d)):
                links.append(os.path.join(root, d))
        dirs.sort()
        for name in names:
            path = os.path.join(root, name)
            if os.path.islink(path):
                if links is not None and name.endswith((".jsonl", ".jsonl.gz")):
                    links.append(path)
            elif name.endswith((".jsonl", ".jsonl.gz")):
                yield path


def as_list(v: Any) -> list:
    """An event field that should be a list, as one: anything else (a log's fields are input) is none."""
    return v if isinstance(v, list) else []


def as_dict(v: Any) -> dict:
    """An event field that should be a mapping, as one: anything else is an empty one."""
    return v if isinstance(v, dict) else {}


def valid_event(d: dict) -> bool:
    """Events carry a numeric time and an int (or absent) rank; a straggler event a list of dicts."""
    if not is_number(d.get("t")) or not (d.get("rank") is None or is_integer(d.get("rank"))) \
            or type(d.get("run", "")) is not str:
        return False
    if d["type"] == "straggler":
        return isinstance(d.get("stragglers", []), list) and all(isinstance(x, dict) for x in d.get("stragglers", []))
    if d["type"] == "lost":
        return is_integer(d.get("records")) and is_integer(d.get("rank"))
    return True


def judge_line(line: bytes) -> Optional[dict]:
    """One JSONL line as a record dict (a str `type`; events checked by valid_event, steps by
    valid_step), or None when the line is corrupt and must be skipped and counted."""
    try:
        # Decoded here: json.loads of bytes first guesses among UTF-8/16/32, a tenth of its cost;
        # the monitor writes UTF-8 (ASCII, in fact).
        d = json.loads(line.decode())
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than the parser goes
        return None
    if not isinstance(d, dict) or not isinstance(d.get("type"), str):
        return None
    if not (valid_step(d) if d["type"] == "step" else valid_event(d)):
        return None
    return d


def _or_nan(v: Optional[float]) -> float:
    return _NAN if v is None else v


class _Columns:
    """Growing columns (array.array: 8 bytes a value, not a Python float), one per FIGURES
    name plus rank, step and verdict."""

    def __init__(self):
        self.rank = array("q")
        self.step = array("q")
        self.verdict = array("b")
        for name in FIGURES:
            setattr(self, name, array("d"))
        self.comm_in_flight = 0  # step lines whose comm is time in flight (RunLog.comm_in_flight)

    def append(self, d: dict) -> None:
        """One valid step line (valid_step)."""
        roles = d.get("roles") or {}
        # data, comm and CPU stall as the parts of the step (records/parts.py), split here once for
        # every view; NaN where the line did not say
        parts = split_step(d["step_ms"], d.get("data_ms"), d.get("comm_ms"), role_runq(roles, "main"))
        dm, cm = d.get("data_ms"), d.get("comm_ms")
        data, comm = _NAN if dm is None else parts.data_ms, _NAN if cm is None else parts.comm_ms
        stall, n = _or_nan(parts.cpu_stall_ms), d.get("steps", 1)
        if "comm_inflight_ms" not in d and cm:
            self.comm_in_flight += 1
        if n != 1:
            return self._append_steps(d, n, data, comm, stall)
        self.rank.append(d["rank"])
        self.step.append(d["step"])
        self.verdict.append(_VERDICT_CODE.get(d.get("verdict"), -1))
        self.t.append(d["t"])
        self.step_ms.append(d["step_ms"])
        self.data_ms.append(data)
        self.comm_ms.append(comm)
        self.stall_ms.append(stall)
        self.enter_t.append(_or_nan(d.get("comm_enter_t")))

    def _append_steps(self, d: dict, n: int, data: float, comm: float, stall: float) -> None:
        """A line of n steps (records/step.py): a row each, its end counted back from the line's `t`."""
        each, ends = d["each_ms"], [d["t"]] * n
        for i in range(n - 1, 0, -1):
            ends[i - 1] = ends[i] - each[i] / 1e3
        for name, col in (("rank", [d["rank"]] * n), ("step", range(d["step"] - n + 1, d["step"] + 1)), ("t", ends),
                          ("verdict", [_VERDICT_CODE.get(d.get("verdict"), -1)] * n), ("step_ms", each),
                          ("data_ms", [data] * n), ("comm_ms", [comm] * n), ("stall_ms", [stall] * n),
                          ("enter_t", [_NAN] * (n - 1) + [_or_nan(d.get("comm_enter_t"))])):
            getattr(self, name).extend(col)

    def extend(self, other: "_Columns") -> None:
        for name in ("rank", "step", "verdict") + FIGURES:
            getattr(self, name).extend(getattr(other, name))
        self.comm_in_flight += other.comm_in_flight

    def numpy(self, name: str, dtype):
        """The column as a numpy array (a view of the column's memory)."""
        import numpy as np

        col = getattr(self, name)
        return np.frombuffer(col, dtype=dtype) if len(col) else np.zeros(0, dtype)


@dataclass
class _Run:
    """One rank's records of one run in the file being read."""

    last_step: int
    columns: _Columns = field(default_factory=_Columns)
    records: list[StepRecord] = field(default_factory=list)


@dataclass
class _Where:
    host: Optional[str] = None
    node_rank: Optional[int] = None
    directory: str = ""

    def said(self) -> bool:
        return self.host is not None or self.node_rank is not None

    def label(self) -> str:
        if self.node_rank is not None:
            return f"node {self.node_rank}" + (f" ({self.host})" if self.host else "")
        return self.host or self.directory or "."


@dataclass
class _FileRead:
    """What one log file holds, read on its own (in a worker process of the pool when there are
    many files): merged into the _Reader in file order."""

    path: str
    directory: str
    events: list[dict[str, Any]] = field(default_factory=list)
    unreadable: Optional[str] = None  # why the file could not be read (it is skipped, the rest read)
    skipped: int = 0
    lost: dict[int, int] = field(default_factory=dict)
    runs: dict[str, RunInfo] = field(default_factory=dict)
    steps: dict[tuple[str, int], _Run] = field(default_factory=dict)  # (run, rank) -> its records here
    earlier: dict[tuple[str, int], int] = field(default_factory=dict)
    said: dict[int, _Where] = field(default_factory=dict)  # rank -> its host/node as start events say
    digests: dict[tuple[str, int], StepDigest] = field(default_factory=dict)  # (run, rank) -> merged here
    step_lines: int = 0  # step lines counted, not parsed (digests_only)


def _read_file(path: str, directory: str, keep_records: bool, digests_only: bool = False) -> _FileRead:
    """Parse one log file, each line once (StepRecords too with `keep_records`); with
    `digests_only`, every line but the step lines, which are counted."""
    out = _FileRead(path, directory)
    try:
        raw = read_bounded(path, LOG_MAX)  # a FIFO or a device is refused, not waited on
        if path.endswith(".gz"):
            raw = _gunzip(path, raw)
    except OSError as e:
        out.unreadable = e.strerror or str(e)
        return out
    except LogReadError as e:
        out.unreadable = str(e)
        return out
    runs, steps = out.runs, out.steps
    if digests_only:
        nl = raw.find(b"\n")
        first = raw if nl < 0 else raw[:nl]
        lines = ([] if first.startswith(_STEP_PREFIX) else [first]) + _NOT_STEP_LINE.findall(raw)
        out.step_lines = raw.count(b"\n" + _STEP_PREFIX) + raw.startswith(_STEP_PREFIX)
    else:
        lines = raw.split(b"\n")
    for line in lines:
        if len(line) > LINE_MAX:  # no line of ours is this long: counted, never parsed
            out.skipped += 1
            continue
        if not line.strip():
            continue
        d = judge_line(line)
        if d is None:
            out.skipped += 1
            continue
        run_id = d.get("run", NO_ID)
        info = runs.get(run_id) or runs.setdefault(run_id, RunInfo(run_id))
        if d["type"] == "digest":
            digest = StepDigest.from_dict(d)
            if digest is None:
                out.skipped += 1
                continue
            info.saw(digest.t)
            out.digests.setdefault((run_id, digest.rank), StepDigest(digest.rank)).merge(digest)
            continue
        if d["type"] != "step":
            out.events.append(d)
            info.saw(d.get("t"))
            if d["type"] == "lost":  # cumulative count: the last one written is the total
                out.lost[d["rank"]] = max(out.lost.get(d["rank"], 0), d["records"])
            elif d["type"] == "start":
                if isinstance(d.get("job"), str):
                    info.job = d["job"]
                if d.get("rank") is not None and (d.get("host") or d.get("node_rank") is not None):
                    out.said[d["rank"]] = _Where(d.get("host"), d.get("node_rank"))
            continue
        rank, step = d["rank"], d["step"]
        run = steps.get((run_id, rank))
        if run is None or step <= run.last_step:
            if run is not None:  # step numbers start over: the same run id begun again
                out.earlier[(run_id, rank)] = out.earlier.get((run_id, rank), 0) + 1
            run = steps[(run_id, rank)] = _Run(step)
        run.last_step = step
        run.columns.append(d)
        info.saw(d["t"])
        if keep_records:
            run.records.append(StepRecord.from_dict(d))
    return out


class _Reader:
    def __init__(self, records_up_to: Optional[int]):
        """records_up_to: keep StepRecords while at most that many ranks are seen; None: none."""
        self.records_up_to = records_up_to
        self.columns: dict[str, _Columns] = {}  # run id -> its step records as columns
        self.records: Optional[dict[tuple[str, int], list[StepRecord]]] = None if records_up_to is None else {}
        self.seen_ranks: set[int] = set()
        self.where: dict[int, _Where] = {}
        self.runs: dict[str, RunInfo] = {}
        self.earlier: dict[tuple[str, int], int] = {}  # (run, rank) -> times its steps started over
        self.digests: dict[tuple[str, int], StepDigest] = {}
        self.digests_only = False
        self.log = RunLog(*([None] * 9))

    def read_file(self, path: str, directory: str) -> None:
        self.merge(_read_file(path, directory, self.records is not None, self.digests_only))

    def merge(self, f: _FileRead) -> None:
        log = self.log
        if f.unreadable is not None:
            log.unreadable.append((f.path, f.unreadable))
            return
        log.skipped += f.skipped
        log.step_lines += f.step_lines

        log.events.extend(f.events)
        for rank, n in f.lost.items():
            log.lost[rank] = max(log.lost.get(rank, 0), n)
        for run_id, info in f.runs.items():
            mine = self.runs.setdefault(run_id, RunInfo(run_id))
            mine.first_t, mine.last_t = min(mine.first_t, info.first_t), max(mine.last_t, info.last_t)
            mine.job = mine.job or info.job
        for key, n in f.earlier.items():
            self.earlier[key] = self.earlier.get(key, 0) + n
        said = dict(f.said)
        for (run_id, rank), digest in f.digests.items():
            self.digests.setdefault((run_id, rank), StepDigest(rank)).merge(digest)
            if self.digests_only:  # the digests stand for the step lines not parsed
                self._saw(rank)
                self.runs[run_id].ranks.add(rank)
                self.runs[run_id].records += digest.steps
                said.setdefault(rank, _Where())
        for (run_id, rank), run in f.steps.items():
            self._saw(rank)
            self.columns.setdefault(run_id, _Columns()).extend(run.columns)
            info = self.runs[run_id]
            info.ranks.add(rank)
            info.records += len(run.columns.rank)
            if self.records is not None:
                self.records.setdefault((run_id, rank), []).extend(run.records)
            said.setdefault(rank, _Where())
        for rank, w in said.items():
            if rank not in self.where or not self.where[rank].said():
                self.where[rank] = _Where(w.host, w.node_rank, f.directory)

    def _saw(self, rank: int) -> None:
        """Drops the StepRecords once the logs hold more ranks than records_up_to."""
        if self.records is not None and rank not in self.seen_ranks:
            self.seen_ranks.add(rank)
            if len(self.seen_ranks) > self.records_up_to:
                self.records = None

    def finish(self, choice: Optional[str] = None) -> RunLog:
        import numpy as np

        log = self.log
        runs = sorted((r for r in self.runs.values() if r.records or r.id != NO_ID or len(self.runs) == 1),
                      key=lambda r: (r.first_t, r.id))
        for n, r in enumerate(runs, 1):
            r.number = n
        log.runs = runs
        log.run = chosen = pick_run(runs, choice)
        run_id = chosen.id if chosen is not None else NO_ID
        cols = self.columns.get(run_id, _Columns())
        log.events = [e for e in log.events if e.get("run", NO_ID) == run_id]
        log.earlier_runs = {rank: n for (rid, rank), n in self.earlier.items() if rid == run_id}
        log.node = {rank: w.label() for rank, w in self.where.items()
                    if chosen is None or rank in chosen.ranks or not chosen.ranks}
        rank, step = cols.numpy("rank", np.int64), cols.numpy("step", np.int64)
        order = np.lexsort((step, rank))
        log.rank, log.step = rank[order], step[order]
        for name in FIGURES:
            setattr(log, name, cols.numpy(name, np.float64)[order])
        log.verdict = cols.numpy("verdict", np.int8)[order]
        log.comm_in_flight = cols.comm_in_flight
        if self.records is not None:
            log.records = {rank: sorted(recs, key=lambda r: r.step) for (rid, rank), recs in self.records.items()
                           if rid == run_id}
        log.from_digests = self.digests_only
        log.digests = {rank: d for (rid, rank), d in sorted(self.digests.items()) if rid == run_id}
        log.events.sort(key=lambda e: e.get("t") if isinstance(e.get("t"), (int, float)) else 0.0)
        return log


def _gunzip(path: str, raw: bytes) -> bytes:
    """A rotated log's lines (events.compress_rotated), at most GZ_EXPAND_MAX times its size
    (placement's logs compress ~10x; a gzip bomb, thousands of times) and never past LOG_MAX; a
    file that is not gzip, or cut short (the writer was killed), gives what could be read."""
    import zlib

    cap = min(LOG_MAX, max(GZ_FLOOR, GZ_EXPAND_MAX * len(raw)))
    d = zlib.decompressobj(wbits=31)
    try:
        out = d.decompress(raw, cap)
    except zlib.error as e:
        raise LogReadError(f"not a gzip file ({e})") from None
    if d.unconsumed_tail:
        raise LogReadError(f"expands past {cap >> 20} MiB ({GZ_EXPAND_MAX}x its size at most): not a rotated "
                           "placement log")
    return out


def pick_run(runs: list[RunInfo], choice: Optional[str]) -> Optional[RunInfo]:
    """The run asked for (its number or id, or an id's unique beginning), or the one that began
    last; LogReadError (one line, naming the runs there are) when none or several match."""
    if not runs:
        return None
    if choice is None:
        return runs[-1]
    text = choice.strip()
    if text.isdigit() and 1 <= int(text) <= len(runs):
        return runs[int(text) - 1]
    # An id's beginning, never digits alone: "3" is a run's number, not the id 3f9c... (which a
    # bad --run 3 of two runs would otherwise pick); an id made of digits is taken whole.
    matches = [r for r in runs if r.id and (r.id == text or (not text.isdigit() and r.id.startswith(text)))] \
        if text else []
    if len(matches) == 1:
        return matches[0]
    listed = "; ".join(f"{r.number} {r.id or '(no id)'}" for r in runs[:10]) + ("; ..." if len(runs) > 10 else "")
    raise LogReadError(f"--run {choice!r} is not valid; valid: a run's number 1..{len(runs)} or its id "
                       f"(these logs hold: {listed})")


PARALLEL_FROM = 8  # files from which they are parsed by a pool of processes (one per CPU)


_ROTATED_PIECE = re.compile(r"^(rank\d+(?:-\d+)?)\.\d+\.jsonl(\.gz)?$")  # (events._ROTATED)


def with_indexes(files: list[str]) -> tuple[list[str], int]:
    """For reading by digests: each rank log with its event index beside it (events.index_path:
    every line but the step lines, of the log and its rotated pieces) is read by the index
    instead, its rotated pieces left out. Returns the files to read and how many indexes."""
    out = []
    indexed = set()
    for f in files:
        if f.endswith(".jsonl") and os.path.exists(index_path(f)):
            indexed.add((os.path.dirname(f), os.path.basename(f)[:-len(".jsonl")]))
    for f in files:
        m = _ROTATED_PIECE.match(os.path.basename(f))
        stem = m.group(1) if m else (os.path.basename(f)[:-len(".jsonl")] if f.endswith(".jsonl") else None)
        if stem is not None and (os.path.dirname(f), stem) in indexed:
            if not m:
                out.append(index_path(f))
            continue
        out.append(f)
    return out, len(indexed)


def _read(files: list[str], records_up_to: Optional[int], run: Optional[str], digests_only: bool = False) -> RunLog:
    reader = _Reader(None if digests_only else records_up_to)
    reader.digests_only = digests_only
    reader.log.files = files
    if digests_only:
        files, reader.log.indexed = with_indexes(files)
    common = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files]) if files else ""
    dirs = []
    for path in files:
        directory = os.path.relpath(os.path.dirname(os.path.abspath(path)), common) if common else ""
        dirs.append(directory if directory != "." else os.path.basename(common))
    workers = min(len(os.sched_getaffinity(0)), len(files))
    if reader.records is None and len(files) >= PARALLEL_FROM and workers > 1:
        # Many files, no StepRecords: the CPU-bound parse runs on every CPU this process may use,
        # a file per task, merged here in file order (the same result as one by one).
        import concurrent.futures
        import multiprocessing

        # spawn, not fork: the caller may hold threads (a lock held across fork would hang a child)
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            n = len(files)
            for f in pool.map(_read_file, files, dirs, [False] * n, [digests_only] * n,
                              chunksize=max(1, n // (8 * workers))):
                reader.merge(f)
    else:
        for path, directory in zip(files, dirs):
            reader.read_file(path, directory)
    if files and len(reader.log.unreadable) == len(files):  # nothing could be read: that is the error
        path, why = reader.log.unreadable[0]
        raise LogReadError(f"cannot read log {path!r}: {why}")
    unreadable = reader.log.unreadable
    log = reader.finish(run)
    log.unreadable = unreadable
    return log


def estimated_step_lines(files: list[str]) -> int:
    """Step lines the files hold, by their size (STEP_LINE_BYTES a line, GZ_RATIO compressed)."""
    total = 0
    for f in files:
        try:
            size = os.stat(f).st_size
        except OSError:
            continue  # said when it is read
        total += size * (GZ_RATIO if f.endswith(".gz") else 1)
    return total // STEP_LINE_BYTES


def long_logs(files: list[str]) -> bool:
    """Whether AUTO reads these files' digests: more than DIGESTS_FROM step lines by their size."""
    return estimated_step_lines(files) > DIGESTS_FROM


def read_logs(paths: list[str], records_up_to: int = RANK_TABLE_MAX, run: Optional[str] = None,
              read: ReadMode = ReadMode.STEPS) -> RunLog:
    """Read every log named (files, directories searched recursively, globs), each line once,
    and keep one run of them: `run` (a number or id, pick_run), else the one that began last.
    `read`: every step line (STEPS), the digests alone (DIGESTS), or the digests when the logs
    hold more than DIGESTS_FROM step lines by their size and have digests (AUTO).
    StepRecords are kept when the logs hold at most `records_up_to` ranks. Each rank writes
    one file (events.log_path), so more files than that are taken for more ranks and no
    StepRecord is built (at 1,024 ranks, building the first 33 ranks' only to drop them would
    cost 4% more memory); should fewer ranks than files have stepped (files of events alone),
    the logs are read again for their StepRecords, the one case a line is parsed twice."""
    links: list[str] = []
    files = expand(paths, links)
    long = read == ReadMode.AUTO and long_logs(files)
    if read == ReadMode.DIGESTS or long:
        log = _read(files, None, run, digests_only=True)
        log.links_skipped = len(links)
        if log.digests or read == ReadMode.DIGESTS:
            return log
        # AUTO, and the logs have no digests (monitor.digest_every=0, or written before them): every line
    log = _read(files, records_up_to if len(files) <= records_up_to else None, run)
    if log.records is None and len(files) > records_up_to and len(log.ranks()) <= records_up_to:
        log = _read(files, records_up_to, run)
    log.long_without_digests = long
    log.links_skipped = len(links)
    return log
