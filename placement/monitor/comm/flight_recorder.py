"""Reading torch's flight recorder: the ring of recent collectives that ProcessGroupNCCL
fills, read incrementally, without losing entries and counting what the ring overwrote.

Upstream
    torch 2.13, include/torch/csrc/distributed/c10d/. Which recorder:
    - FlightRecorder<EventType> is a per-EventType singleton (FlightRecorder.hpp:97-104).
      ProcessGroupNCCL records into FlightRecorder<at::cuda::CUDAEvent> (ProcessGroupNCCL.cpp:
      `using FlightRecorderCUDA = FlightRecorder<at::cuda::CUDAEvent>`), dumped by
      dump_nccl_trace_json (ProcessGroupNCCL.hpp:1516, Python `_dump_nccl_trace_json`, and the
      control-plane handler "dump_nccl_trace_json" registered in FlightRecorderCuda.cpp). Both
      exist only in CUDA builds (USE_C10D_NCCL).
    - dump_fr_trace_json (FlightRecorder.hpp:329, Python `_dump_fr_trace_json`, handler
      "fr_trace_json") dumps FlightRecorder<c10::Event>: gloo and CPU work. Reading it on a
      CUDA build finds no NCCL entry. Newer upstream merges the two; then only the generic
      one exists and holds the `nccl:` entries, so it is the fallback (and is probed once when
      the NCCL one shows no NCCL entry).
    - ring size: TORCH_FR_BUFFER_SIZE, else TORCH_NCCL_TRACE_BUFFER_SIZE, default 2000; 0 turns
      recording off (FlightRecorder.hpp:110-111); read once, when the singleton is made.

    The JSON an entry becomes (FlightRecorderDetail.hpp:506-597, nlohmann::json, keys sorted):
    `record_id` ascending in ring order (dump_entries, :205-231, oldest first), `profiling_name`
    ("nccl:all_reduce"), `time_created_ns` from c10::getTime() = CLOCK_REALTIME (:117,
    c10/util/ApproximateClock.h:66), the CPU enqueue time; `duration_ms` only when computed
    (:537-539): retire_id computes it from the start and end CUDA events (:289-316), and a
    start event exists only with timing on (TORCH_NCCL_ENABLE_TIMING, ProcessGroupNCCL.hpp:
    88-94); `state` completed / started / scheduled (:567-573); `time_discovered_*_ns` 0 when
    unknown (:574-581; None in the pickle dump, :427-436); `retired` once the watchdog let go of it.

Why the worker server
    Formatting the dump costs per entry, and the Python binding holds the GIL for all of it, so
    the main thread stalls for the whole dump (figures: docs/monitor.md, Step records and comm
    timing). torch's control-plane worker server runs the same dump on its own C++ thread with
    the GIL released (measured by benchmarks/comm_flight_recorder.py), so it is the route used
    when torch has it.

Cost
    Through the worker server the GIL is held only to take the answer, find where the new
    entries start and parse those.
"""
from __future__ import annotations

import enum
import functools
import itertools
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from placement.events import private_dir

DEFAULT_RING = 2000  # FlightRecorder.hpp:110-111 (duplicated in ProcessGroupNCCL.cpp)

# (recorder, route, name) in order of preference.
NCCL, GENERIC = "nccl", "generic"
_SERVER_NUMBERS = itertools.count()  # worker-server socket paths of this process

_SOURCES = (
    (NCCL, "server", "dump_nccl_trace_json"),  # FlightRecorderCuda.cpp jsonDumpHandler
    (NCCL, "binding", "_dump_nccl_trace_json"),
    (NCCL, "pickle", "_dump_nccl_trace"),  # torch 2.4: pickle only
    (GENERIC, "server", "fr_trace_json"),
    (GENERIC, "binding", "_dump_fr_trace_json"),
)


RING_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # FlightRecorder.hpp:110-111, first wins


@dataclass(frozen=True)
class RingSetting:
    """The ring size torch uses and where it comes from (None: torch's default)."""

    size: int
    variable: Optional[str]

    def __str__(self) -> str:
        return f"{self.variable}={self.size}" if self.variable else f"torch's default of {self.size}"


def ring_setting(environ=os.environ) -> RingSetting:
    """The ring size torch reads (FlightRecorder.hpp:110-111: TORCH_FR_BUFFER_SIZE, falling back
    to TORCH_NCCL_TRACE_BUFFER_SIZE, then DEFAULT_RING), naming the variable in force. c10d's
    getCvarInt parses with std::stoi: leading blanks, a sign and the leading digits ("12abc" is 12);
    a value with no digits falls back to the default."""
    for key in RING_VARIABLES:
        value = environ.get(key)
        if value is not None:
            m = re.match(r"\s*([+-]?\d+)", value)
            return RingSetting(int(m.group(1)), key) if m else RingSetting(DEFAULT_RING, None)
    return RingSetting(DEFAULT_RING, None)


@dataclass(frozen=True)
class FrEntry:
    """One collective as the flight recorder dumps it."""

    record_id: int
    pg_id: int
    name: str  # profiling_name, e.g. "nccl:all_reduce"
    created_s: float  # time_created_ns / 1e9: CLOCK_REALTIME, comparable with time.time()
    duration_ms: Optional[float]  # GPU time between its start and end events; None without timing
    completed: bool
    retired: bool
    owed: bool = False  # timing was on and its duration never came (Settled.MISSING): its step is null

    @classmethod
    def from_dict(cls, e: dict, owed: bool = False) -> "FrEntry":
        dur = e.get("duration_ms")
        return cls(int(e["record_id"]), int(e.get("pg_id", -1)), str(e.get("profiling_name", "")),
                   int(e.get("time_created_ns") or 0) / 1e9, None if dur is None else float(dur),
                   e.get("state") == "completed", bool(e.get("retired", False)), owed)


# ---- dumping -------------------------------------------------------------------------------
class DumpSource:
    """One way of dumping one recorder; dump() returns the JSON text or, for the pickle
    route, the decoded dict."""

    def __init__(self, recorder: str, route: str, name: str, fn: Callable, closer: Optional[Callable] = None):
        self.recorder = recorder
        self.route = route
        self.name = name
        self._fn = fn
        self._closer = closer

    @property
    def gil_free(self) -> bool:
        """Whether torch formats the dump without the GIL (the worker-server route)."""
        return self.route == "server"

    def dump(self) -> Union[str, dict]:
        return self._fn()

    def close(self) -> None:
        if self._closer is not None:
            self._closer()

    def __repr__(self) -> str:
        return f"{self.route} {self.name}"


class WorkerServer:
    """torch's control-plane WorkerServer (`_WorkerServer`, what torch.distributed.elastic's
    worker_main starts on TORCH_WORKER_SERVER_SOCKET) on a private unix socket of this process,
    started at the first dump. A POST to /handler/<name> runs the handler on the server's C++
    thread, without the GIL, with a C++ Request: the NCCL handler reads req.params(), which a
    Python-made _Request cannot answer (its pybind trampoline cannot cast a dict to the
    std::multimap that Handlers.hpp:22 returns; tested here). Reading the answer from the socket
    releases the GIL too."""

    def __init__(self, c10d):
        self._c10d = c10d
        self._server = None
        self.path: Optional[str] = None

    def fetch(self, handler: str) -> str:
        import http.client
        import socket

        if self._server is None:
            import tempfile

            # A number of this process's own, not id(self): an id is reused once its object is
            # gone, and a server dropped without close() leaves its socket file behind (the
            # worker server refuses a path that exists). A file at a fresh number is left by an
            # earlier process of this pid, dead: removed.
            # In a directory of this user's alone (mode 0700, checked with lstat): another user
            # can neither pre-create the path (the unlink would fail and the monitor fall back
            # to the dump that holds the GIL) nor reach the socket (torch's handlers: stacks,
            # NCCL traces) whatever the umask. UnsafePlace (an OSError) when it is not ours.
            home = private_dir(os.path.join(tempfile.gettempdir(), f"placement-{os.geteuid()}"))
            self.path = os.path.join(home, f"fr-{os.getpid()}-{next(_SERVER_NUMBERS)}.sock")
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._server = self._c10d._WorkerServer(self.path, -1)
        path = self.path

        class _Unix(http.client.HTTPConnection):
            def connect(self):
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(self.timeout)
                self.sock.connect(path)

        conn = _Unix("localhost", timeout=30.0)
        try:
            conn.request("POST", f"/handler/{handler}")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"{handler} answered {response.status}: {body[:200]!r}")
        return body.decode()

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            try:
                server.shutdown()
            finally:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass


def _binding_dump(fn: Callable) -> Callable[[], str]:
    def dump() -> str:
        raw = fn(True, False)  # includeCollectives, onlyActive (onlyActive would drop completed ones)
        return raw.decode() if isinstance(raw, bytes) else raw

    return dump


def _pickle_dump(fn: Callable) -> Callable[[], dict]:
    import pickle

    def dump() -> dict:
        return pickle.loads(fn(True, False, False))  # includeCollectives, includeStackTraces, onlyActive

    return dump


def dump_sources(c10d=None) -> list[DumpSource]:
    """The dump routes this torch offers, preferred first. The worker-server ones share one
    server, started at their first dump and shut down by their close()."""
    if c10d is None:
        try:
            import torch._C._distributed_c10d as c10d
        except ImportError:
            return []
    try:
        handlers = set(c10d._get_handler_names()) if hasattr(c10d, "_get_handler_names") else set()
    except Exception:
        handlers = set()
    server = WorkerServer(c10d) if hasattr(c10d, "_WorkerServer") else None
    out = []
    for recorder, route, name in _SOURCES:
        if route == "server":
            if server is not None and name in handlers:
                out.append(DumpSource(recorder, route, name, functools.partial(server.fetch, name), server.close))
        else:
            fn = getattr(c10d, name, None)
            if fn is not None:
                out.append(DumpSource(recorder, route, name, (_pickle_dump if route == "pickle" else _binding_dump)(fn)))
    return out


# ---- parsing only what is new ------------------------------------------------------------------
_ENTRIES = '"entries":['
_RID = '"record_id":'


def _int_at(text: str, pos: int) -> int:
    end = pos
    while text[end].isdigit():
        end += 1
    return int(text[pos:end])


def entries_from(dump: Union[str, dict], from_id: int) -> tuple[list[dict], Optional[int]]:
    """The dumped entries with record_id >= from_id (ids ascend in ring order), and the
    oldest id the dump holds (None when it holds none). On JSON text only the tail from
    `from_id` on is parsed: the rest of the ring was read before."""
    if isinstance(dump, dict):
        entries = dump.get("entries") or []
        if not entries:
            return [], None
        first, last = int(entries[0]["record_id"]), int(entries[-1]["record_id"])
        if from_id > last + 1:
            raise ValueError(f"record ids went back to {first}..{last}, below {from_id}")
        return list(entries[max(0, from_id - first):]), first
    start = dump.find(_ENTRIES)
    if start < 0:  # "entries" is left out when the ring is empty (FlightRecorderDetail.hpp:588-590)
        return [], None
    start += len(_ENTRIES)
    first = _int_at(dump, dump.index(_RID, start) + len(_RID))
    # In an entry's object no '{' or '}' but its own: the array ends at the first "}]".
    end = dump.index("}]", start) + 1
    if from_id > first:
        last = _int_at(dump, dump.rindex(_RID, start, end) + len(_RID))
        if from_id > last + 1:  # ids went back: a reset starts them again at 0
            raise ValueError(f"record ids went back to {first}..{last}, below {from_id}")
        if from_id == last + 1:
            return [], first
        at = dump.index(f"{_RID}{from_id},", start, end)
        start = dump.rindex("{", start, at)
    return json.loads("[" + dump[start:end] + "]"), first


# ---- the incremental reader ------------------------------------------------------------------
class Settled(enum.Enum):
    """What a dumped entry says of its collective's duration."""

    PENDING = "pending"  # not settled: its duration may still come
    TIMED = "timed"  # duration_ms is there
    UNTIMED = "untimed"  # settled and no duration will come, nor is one owed (timing off; a record without events)
    MISSING = "missing"  # settled, timing on, and its duration never came: its step's comm time is null


def settled_test(raw: list[dict], timing_on: bool,
                 retired_before: frozenset = frozenset()) -> Callable[[dict], Settled]:
    """How a dumped entry of `raw` stands (torch 2.13, include/torch/csrc/distributed/c10d/):

    - `duration_ms` is written by retire_id only (FlightRecorderDetail.hpp:270-317), which the
      watchdog thread calls for a work it found completed, on its own cadence
      (kWatchdogThreadSleepMillis, 100 ms, ProcessGroupNCCL.hpp; Watchdog::runLoop). A dump
      queries the end event on a *copy* of each entry (dump_entries, :204-231), so `state` says
      "completed" as soon as the GPU finished, up to a watchdog period before the duration
      exists. With timing on, completed is therefore not settled: retired with its duration is.
    - retire_id sets `retired_` under the recorder's lock, then computes the duration with the
      lock released (:295-316), so a dump can show retired without the duration for a moment:
      one more poll is waited for (`retired_before`: ids seen so at the previous poll); still
      without, the duration is MISSING (retire abandoned: the entry was overwritten, :309-312).
    - A record made without events (the ops inside a coalesced group: their time is the group
      record's) never completes; it is settled once a later entry of its group (one stream, in
      order) has completed or retired. Its own duration is not owed: UNTIMED.
    - Timing off: nothing writes a duration; completed or retired is settled, UNTIMED."""
    newest_done: dict[int, int] = {}
    for e in raw:
        if e.get("state") == "completed" or e.get("retired"):
            newest_done[e.get("pg_id", -1)] = e["record_id"]

    def settled(e: dict) -> Settled:
        if e.get("duration_ms") is not None:
            return Settled.TIMED
        completed, retired = e.get("state") == "completed", bool(e.get("retired"))
        if not (completed or retired):
            return (Settled.UNTIMED if newest_done.get(e.get("pg_id", -1), -1) > e["record_id"]
                    else Settled.PENDING)
        if not timing_on:
            return Settled.UNTIMED
        if not completed:  # retired with no end event: a record without events
            return Settled.UNTIMED
        if retired and e["record_id"] in retired_before:
            return Settled.MISSING
        return Settled.PENDING  # completed: the watchdog has not retired it, or is computing its duration

    return settled


@dataclass
class RingRead:
    """What one poll found."""

    entries: list[FrEntry]  # newly settled entries whose name has the prefix, in id order
    lost: int  # records overwritten before they could be read
    lost_span: Optional[tuple[float, float]]  # wall times between which the lost ones were created
    seen: int  # entries with the prefix in this dump (settled or not)
    settled: int = 0  # entries of any name newly settled
    # created_s of the entries with the prefix still PENDING: the steps holding them wait
    pending: list[float] = field(default_factory=list)
    missing: int = 0  # newly settled entries with the prefix whose duration never came (Settled.MISSING)


@dataclass
class RingReader:
    """Hands out each entry once, when it is settled (settled_test). Entries of groups that
    overlap finish out of id order, so the reader keeps a low-water mark (every id below it
    is settled) and the settled ids above it, never just the highest id seen."""

    prefix: str = "nccl:"
    # Whether collective timing is on (durations are owed). Off, an entry is settled once done.
    timing_on: bool = False
    low: int = 0
    # The first read starts at the oldest record the ring still holds: records overwritten
    # before the monitor started are not lost by it.
    started: bool = False
    # Records created before this wall time (the monitor's start) are skipped, not handed out.
    not_before: float = 0.0
    done: set = field(default_factory=set)
    overflow: int = 0  # records lost to the ring wrapping between polls, in all
    _last_created: float = 0.0  # created time of the newest entry read so far
    _retired_without_duration: frozenset = frozenset()  # ids seen retired with no duration at the last read

    def mark_start(self, dump: Union[str, dict]) -> None:
        """Start at the end of the ring as it is now (the monitor's start): a later read that
        finds the ring wrapped past this point counts what it lost."""
        raw, first = entries_from(dump, 0)
        if not self.started:
            self.started = True  # an empty ring: ids start at 0 (FlightRecorder::record, id_++)
            if first is not None:
                self.low = max(self.low, int(raw[-1]["record_id"]) + 1)

    def read(self, dump: Union[str, dict]) -> RingRead:
        try:
            raw, first = entries_from(dump, self.low)
        except ValueError:  # ids went back: the recorder was reset (FlightRecorderDetail.hpp:328-337)
            self.low, self.done = 0, set()
            raw, first = entries_from(dump, 0)
        if first is None:
            return RingRead([], 0, None, 0)
        lost, lost_span = 0, None
        if not self.started:
            self.started = True
            self.low = max(self.low, first)
        if first > self.low:  # the ring wrapped past records never read
            lost = sum(1 for i in range(self.low, first) if i not in self.done)
            self.overflow += lost
            if lost:
                lost_span = (self._last_created, int(raw[0].get("time_created_ns") or 0) / 1e9 if raw else time.time())
            self.done = {i for i in self.done if i >= first}
            self.low = first
        how = settled_test(raw, self.timing_on or any(e.get("duration_ms") is not None for e in raw),
                           self._retired_without_duration)
        out, pending = [], []
        seen = settled = missing = 0
        retired_waiting = set()
        prefix, done = self.prefix, self.done
        not_before_ns = int(self.not_before * 1e9)
        for e in raw:
            rid = e["record_id"]
            if int(e.get("time_created_ns") or 0) < not_before_ns:
                done.add(rid)
                continue
            ours = str(e.get("profiling_name", "")).startswith(prefix)
            seen += ours
            if rid in done:
                continue
            state = how(e)
            if state is Settled.PENDING:
                if e.get("retired"):
                    retired_waiting.add(rid)
                if ours:
                    pending.append(int(e.get("time_created_ns") or 0) / 1e9)
                continue
            done.add(rid)
            settled += 1
            if ours:
                missing += state is Settled.MISSING
                out.append(FrEntry.from_dict(e, owed=state is Settled.MISSING))
        self._retired_without_duration = frozenset(retired_waiting)
        while self.low in done:
            done.discard(self.low)
            self.low += 1
        if raw:
            self._last_created = max(self._last_created, int(raw[-1].get("time_created_ns") or 0) / 1e9)
        return RingRead(out, lost, lost_span, seen, settled, pending, missing)
