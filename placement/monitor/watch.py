"""Data wait: time spent inside the wrapped iterator's __next__ (blocked on the next batch)."""
from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator


class WatchedIterator:
    __slots__ = ("_it", "_add")

    def __init__(self, it: Iterator, add: Callable[[int], None]):
        self._it = it
        self._add = add

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter_ns()
        try:
            return next(self._it)
        finally:
            self._add(time.perf_counter_ns() - t0)


class WatchedIterable:
    """Wraps a DataLoader (or any iterable or iterator); every other attribute passes through."""

    def __init__(self, source: Iterable, add: Callable[[int], None]):
        self._source = source
        self._add = add

    def __iter__(self) -> WatchedIterator:
        t0 = time.perf_counter_ns()  # a DataLoader starts its workers here: that is data wait too
        it = iter(self._source)
        self._add(time.perf_counter_ns() - t0)
        return WatchedIterator(it, self._add)

    def __next__(self):  # the wrapped object was itself an iterator
        t0 = time.perf_counter_ns()
        try:
            return next(self._source)
        finally:
            self._add(time.perf_counter_ns() - t0)

    def __len__(self) -> int:
        return len(self._source)

    def __getattr__(self, name: str):
        return getattr(self._source, name)
