"""CPU sets as frozensets of ints, and the kernel's two text forms of them.

Every placement decision is set algebra on these (intersect with allowed, subtract
reserved); the text forms exist only at the edges (sysfs, /proc, config, output).
"""
from __future__ import annotations

from typing import Iterable

# The kernel's ceiling on CPU ids: CONFIG_NR_CPUS is at most 8192 on every architecture
# (x86 MAXSMP, powerpc, arm64 4096). A larger id is refused before any set is allocated.
MAX_CPUS = 8192


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse the kernel list form: "0-3,8,10-11" (also "0-15:2" strides). Empty -> empty set.

    Tolerates NUL bytes and surrounding whitespace, as sysfs files may carry them.
    Raises ValueError on anything else.
    """
    text = text.replace("\x00", "").strip()
    cpus: set[int] = set()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        stride = 1
        if ":" in part:
            part, s = part.split(":", 1)
            stride = int(s)
            if stride <= 0:
                raise ValueError(f"bad stride in cpu list {text!r}")
        if "-" in part:
            lo, hi = part.split("-", 1)
            lo_i, hi_i = int(lo), int(hi)
            if lo_i < 0 or hi_i < lo_i:
                raise ValueError(f"bad range {part!r} in cpu list {_short(text)!r}")
            if hi_i >= MAX_CPUS:
                raise ValueError(f"cpu {hi_i} is beyond the kernel's limit of {MAX_CPUS} cpus")
            cpus.update(range(lo_i, hi_i + 1, stride))
        else:
            v = int(part)
            if v < 0:
                raise ValueError(f"negative cpu in cpu list {_short(text)!r}")
            if v >= MAX_CPUS:
                raise ValueError(f"cpu {v} is beyond the kernel's limit of {MAX_CPUS} cpus")
            cpus.add(v)
    return frozenset(cpus)


def parse_cpumask(text: str) -> frozenset[int]:
    """Parse the kernel hex mask form: "ff,0000000f" (32-bit words, most significant first)."""
    text = text.replace("\x00", "").strip().replace(",", "")
    if text.startswith(("0x", "0X")):
        text = text[2:]
    if not text:
        return frozenset()
    if len(text.lstrip("0")) > MAX_CPUS // 4:
        raise ValueError(f"cpu mask of {len(text.lstrip('0')) * 4} bits is beyond the kernel's limit of {MAX_CPUS} cpus")
    value = int(text, 16)
    cpus = set()
    bit = 0
    while value:
        if value & 1:
            cpus.add(bit)
        value >>= 1
        bit += 1
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Kernel list form of a set: {0,1,2,3,8} -> "0-3,8"; empty -> ""."""
    ordered = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def format_cpumask(cpus: Iterable[int]) -> str:
    """Kernel hex mask form, comma between 32-bit words: {0,33} -> "00000002,00000001"."""
    value = 0
    for c in cpus:
        value |= 1 << c
    hexstr = f"{value:x}"
    width = max(8, ((len(hexstr) + 7) // 8) * 8)
    hexstr = hexstr.rjust(width, "0")
    return ",".join(hexstr[i : i + 8] for i in range(0, width, 8))


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
