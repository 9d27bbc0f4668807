"""The base of the project's closed sets of names (policies, memory modes, event kinds, ...).

A member is a `str` equal to its value and prints as its value, so it goes wherever a string
went (JSON, YAML written by hand, f-strings, `==` with text read back from a log) and the
files placement writes read exactly as before. Each set lives beside the code that owns it
(config.Policy, events.EventKind, topology.model.NodeKind, ...). enum.StrEnum does the same
from Python 3.11; the project supports 3.10.
"""
from __future__ import annotations

import enum


class Vocabulary(str, enum.Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)
