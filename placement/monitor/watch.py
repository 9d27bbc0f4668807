"""Data wait: time spent inside the wrapped iterator's __next__ (blocked on the next batch).

The wrapper runs on the training thread every step, right after the step's compute, when
every code path is cold: it adds to the monitor's counter in place (`counter.data_ns`), one
frame, no call into the monitor.
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Iterable, Iterator, Protocol


class DataWaitCounter(Protocol):
    data_ns: int  # data wait of the current step, taken by the step hook
    last_batch: object  # the last batch handed out: the residence watch asks where its buffers are


class WatchedIterator:
    __slots__ = ("_it", "_counter")

    def __init__(self, it: Iterator, counter: DataWaitCounter):
        self._it = it
        self._counter = counter

    def __iter__(self):
        return self

    def __next__(self):
        t0 = perf_counter_ns()
        try:
            batch = next(self._it)
        finally:
            self._counter.data_ns += perf_counter_ns() - t0
        self._counter.last_batch = batch
        return batch


class WatchedIterable:
    """Wraps a DataLoader (or any iterable or iterator); every other attribute passes through."""

    def __init__(self, source: Iterable, counter: DataWaitCounter):
        self._source = source
        self._counter = counter

    def __iter__(self) -> WatchedIterator:
        t0 = perf_counter_ns()  # a DataLoader starts its workers here: that is data wait too
        it = iter(self._source)
        self._counter.data_ns += perf_counter_ns() - t0
        return WatchedIterator(it, self._counter)

    def __next__(self):  # the wrapped object was itself an iterator
        t0 = perf_counter_ns()
        try:
            return next(self._source)
        finally:
            self._counter.data_ns += perf_counter_ns() - t0

    def __len__(self) -> int:
        return len(self._source)

    def __getattr__(self, name: str):
        return getattr(self._source, name)
