"""Where built step records go: one interface (RecordSink), one class per output. The monitor
thread builds a batch of records (StepMonitor._finalize) and hands it to each sink in order:
the rank's JSONL log, the observers (the tuner), the window the next exchange sends, the
one-line summary, the digests of the log (records/digest.py), TensorBoard. A sink that fails is said once and does not stop the others.
"""
from __future__ import annotations

import bisect
import functools
from typing import Callable, Protocol, Sequence

from placement.events import EventKind, EventLog
from placement.records.digest import StepDigest
from placement.monitor.sinks.jsonl import write_records
from placement.records.step import StepRecord
from placement.monitor.stragglers.figures import RankFigures, figures_from_records
from placement.records.summary import one_line, summarize
from placement.monitor.sinks.tensorboard import open_writer, write_batch
from placement.monitor.warn import WarnOnce, first_line, log


class RecordSink(Protocol):
    name: str

    def write(self, batch: Sequence[StepRecord]) -> None:
        """Take a batch of records, in step order (monitor thread, under the monitor's lock)."""

    def close(self) -> None:
        """At the monitor's close, after its last batch."""


class JsonlSink:
    """The rank's log: one pre-encoded line per record, one write per batch (jsonl.py)."""

    name = "jsonl"

    def __init__(self, events: EventLog):
        self.events = events

    def write(self, batch: Sequence[StepRecord]) -> None:
        write_records(self.events, batch)

    def close(self) -> None:
        pass


class ObserverSink:
    """The observers (the tuner): each gets every record, in step order, a batch at a time; an
    observer that raises is removed and said once (the monitor never breaks training for one)."""

    name = "observers"

    def __init__(self, warn: WarnOnce):
        self.warn = warn
        self._observers: list[tuple[Callable[[Sequence[StepRecord]], None], str]] = []

    def add(self, observe: Callable, batch: bool) -> None:
        """observe(batch of records), or with `batch` False observe(record) for each."""
        name = repr(getattr(observe, "__qualname__", observe))
        self._observers.append((observe if batch else functools.partial(_each, observe), name))

    def write(self, batch: Sequence[StepRecord]) -> None:
        for entry in list(self._observers):
            try:
                entry[0](batch)
            except Exception as e:
                self._observers.remove(entry)
                self.warn(f"observer:{id(entry)}", f"step observer {entry[1]} raised ({type(e).__name__}: "
                                                   f"{first_line(e)}); it is removed")

    def close(self) -> None:
        pass


def _each(observe: Callable[[StepRecord], None], batch: Sequence[StepRecord]) -> None:
    for rec in batch:
        observe(rec)


def _step(record: StepRecord) -> int:
    return record.step


class ExchangeWindow:
    """The records the next exchange sends figures of (kept only while an exchange is on)."""

    name = "exchange"

    def __init__(self, rank: int, enabled: Callable[[], bool]):
        self.rank = rank
        self._enabled = enabled
        self.records: list[StepRecord] = []

    def write(self, batch: Sequence[StepRecord]) -> None:
        if self._enabled():
            self.records.extend(batch)

    def take(self, first: int, last: int) -> RankFigures:
        """The figures of steps first..last; records up to `last` are dropped. The records are in
        step order: the window's are a prefix (a hand-over stretched by the budget holds tens of
        windows, each taken in turn: the whole list read and rebuilt for each was quadratic)."""
        records = self.records
        end = bisect.bisect_right(records, last, key=_step)
        figs = figures_from_records(self.rank, records[:end], first, last)
        del records[:end]
        return figs

    def close(self) -> None:
        pass


class SummarySink:
    """One log line every `every` steps (monitor.summary_every; 0: none)."""

    name = "summary"

    def __init__(self, rank: int, every: int):
        self.rank, self.every = rank, every
        self._records: list[StepRecord] = []
        self._steps = 0  # the steps those records hold

    def write(self, batch: Sequence[StepRecord]) -> None:
        if not self.every:
            return
        self._records.extend(batch)
        self._steps += sum([r.steps for r in batch])
        if self._steps >= self.every:
            s = summarize(self.rank, self._records)
            self._records, self._steps = [], 0
            if s is not None:
                log.info(one_line(s))

    def close(self) -> None:
        pass


class DigestSink:
    """A `digest` event every `every` records (monitor.digest_every; 0: none), and one for the
    records left at close: what `placement report` reads of a long job (records/digest.py)."""

    name = "digest"

    def __init__(self, events: EventLog, rank: int, every: int):
        self.events, self.rank, self.every = events, rank, every
        self._digest = StepDigest(rank)

    def write(self, batch: Sequence[StepRecord]) -> None:
        if not self.every:
            return
        for rec in batch:
            self._digest.add(rec)
            if self._digest.steps >= self.every:
                self._write()

    def _write(self) -> None:
        digest, self._digest = self._digest, StepDigest(self.rank)
        self.events.event(EventKind.DIGEST, **digest.fields())

    def close(self) -> None:
        if self._digest.steps:
            self._write()


class TensorBoardSink:
    """TensorBoard scalars, one point per batch (tensorboard.py)."""

    name = "tensorboard"

    def __init__(self, log_dir: str, rank: int, warn: WarnOnce):
        self._writer = open_writer(log_dir, rank, warn)

    def write(self, batch: Sequence[StepRecord]) -> None:
        write_batch(self._writer, batch)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def write_to_sinks(sinks: Sequence[RecordSink], batch: Sequence[StepRecord], warn: WarnOnce) -> None:
    for sink in sinks:
        try:
            sink.write(batch)
        except Exception as e:
            warn(f"sink-{sink.name}", f"step records could not go to {sink.name} ({type(e).__name__}: "
                                      f"{first_line(e)}); the other outputs go on")


def close_sinks(sinks: Sequence[RecordSink], warn: WarnOnce) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception as e:
            warn(f"sink-close-{sink.name}", f"{sink.name} did not close ({first_line(e)})")


class Delivery:
    """The monitor's outputs, in order: the rank's log, the observers (the tuner), the window the
    next exchange sends, the summary, the digests, TensorBoard where it is on, then the sinks
    added since (the live metrics). Callers register through add_sink and add_observer; the
    monitor thread writes each batch and takes the exchange's windows."""

    def __init__(self, cfg, events: EventLog, rank: int, warn: WarnOnce, exchange_on: Callable[[], bool]):
        self._warn = warn
        self._observers = ObserverSink(warn)
        self._window = ExchangeWindow(rank, exchange_on)
        self._sinks: list[RecordSink] = [JsonlSink(events), self._observers, self._window,
                                         SummarySink(rank, cfg.summary_every), DigestSink(events, rank, cfg.digest_every)]
        if cfg.tensorboard:
            self._sinks.append(TensorBoardSink(cfg.log_dir, rank, warn))

    def add_sink(self, sink: RecordSink, first: bool = False) -> None:
        """Hand `sink` every batch from now on: after the others, or before them with `first`."""
        self._sinks.insert(0 if first else len(self._sinks), sink)

    def add_observer(self, observe: Callable, batch: bool = False) -> None:
        """Call observe(record) for every record from now on, in step order (with `batch`:
        observe(records), a batch at a time)."""
        self._observers.add(observe, batch)

    def write(self, batch: Sequence[StepRecord]) -> None:
        write_to_sinks(self._sinks, batch, self._warn)

    def window(self, first: int, last: int) -> RankFigures:
        """The figures of steps first..last for the exchange (records up to `last` are let go)."""
        return self._window.take(first, last)

    def close(self) -> None:
        close_sinks(self._sinks, self._warn)
