"""Memory residence: the share of a rank's resident pages that sit on its planned NUMA node(s).

The memory policy read back with get_mempolicy (_procfs.py) says where NEW pages go. The pages
themselves can be elsewhere: touched before the policy was set, taken from a cache filled by a
thread bound to another node (PyTorch's pinned host allocator reuses blocks freed by threads on
another node: pytorch/pytorch#160420), or placed by a policy the container narrowed. So the
pages are asked where they are, two ways (placement._procfs parses both):

- sample (the default, `ResidenceSource.MOVE_PAGES`): SAMPLE_PAGES addresses spread evenly over
  the process's anonymous read-write mappings (its data: heap, arenas, tensor storage; from
  /proc/<pid>/maps, which walks no page table), each asked with move_pages(2) in query mode
  (nodes = NULL: nothing moves). The kernel holds the mmap lock for the call, looking up only
  the pages asked: tens of microseconds per thousand pages whatever the process's size, so it
  runs at any time without stalling the training thread (benchmarks/residence.py).
- full read (`ResidenceSource.NUMA_MAPS`): /proc/<pid>/numa_maps counts every page of every
  mapping, walking all page tables under the mmap lock: milliseconds per GiB resident, during
  which the process's own mmap/munmap (and page faults on kernels without per-VMA locks) wait.
  Exact, so tests and one-off looks use it; never the periodic watch.

File-backed pages (libraries, page cache) are not counted: they are shared with other processes
and sit where whoever read them first put them.

The answer seam: every reader takes `query` (addresses -> node or -errno per page) and `proc`
(the /proc root), so fixtures give any number of nodes without touching the kernel.
"""
from __future__ import annotations

import enum
import errno
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from placement import _procfs
from placement.cpuset import format_cpulist

SAMPLE_PAGES = 2048  # addresses asked per look: ~1% error on the share (the look's cost: health/residence.py)
PAGE = 4096  # the sampling stride unit (huge pages are asked once per 4 KiB address, i.e. by size)

Query = Callable[[Sequence[int]], Sequence[int]]


class ResidenceSource(str, enum.Enum):
    MOVE_PAGES = "move_pages"  # a sample of pages asked with move_pages(2)
    NUMA_MAPS = "numa_maps"  # every page, counted by the kernel in /proc/<pid>/numa_maps


@dataclass(frozen=True)
class Residence:
    """Where the pages of one thing (the process, a DataLoader's batch buffers) are."""

    what: str  # "process" or "batch buffers" / "pinned batch buffers"
    planned: tuple[int, ...]  # the nodes its pages should be on (empty: no node planned)
    by_node: dict[int, int] = field(default_factory=dict)  # pages (sampled or counted) per node
    source: ResidenceSource = ResidenceSource.MOVE_PAGES
    asked: int = 0  # addresses asked (sample) or pages counted (full read)
    absent: int = 0  # addresses asked with no page behind them (never touched, swapped out)
    cost_us: float = 0.0  # wall time the look took (maps read + move_pages, or numa_maps read)

    @property
    def resident(self) -> int:
        return sum(self.by_node.values())

    @property
    def share_pct(self) -> Optional[float]:
        """% of the resident pages on the planned nodes; None with no page seen or no node planned."""
        if not self.resident or not self.planned:
            return None
        return 100.0 * sum(n for node, n in self.by_node.items() if node in self.planned) / self.resident

    def elsewhere(self) -> dict[int, float]:
        """node -> % of the resident pages there, for the nodes not planned (most first)."""
        total = self.resident or 1
        return dict(sorted(((node, 100.0 * n / total) for node, n in self.by_node.items()
                            if node not in self.planned), key=lambda kv: -kv[1]))

    def describe(self) -> str:
        """One line: '99.8% of 1790 sampled resident pages on node 0 (1 on node 1; move_pages, 310 us)'."""
        how = "sampled resident pages" if self.source is ResidenceSource.MOVE_PAGES else "resident pages"
        where = "no node planned" if not self.planned else f"node {format_cpulist(self.planned)}"
        share = self.share_pct
        head = (f"{self.resident} {how}" if share is None else f"{share:.1f}% of {self.resident} {how} on {where}")
        if not self.resident:
            head = f"no resident page among {self.asked} asked"
        rest = [f"{pct:.1f}% on node {node}" for node, pct in self.elsewhere().items()]
        return f"{self.what}: {head}" + (f" ({', '.join(rest)})" if rest else "") + \
            f" [{self.source.value}, {self.cost_us:.0f} us]"

    def to_dict(self) -> dict[str, Any]:
        share = self.share_pct
        return {"what": self.what, "planned": list(self.planned), "share_pct": None if share is None else round(share, 2),
                "by_node": {str(k): v for k, v in sorted(self.by_node.items())}, "source": self.source.value,
                "asked": self.asked, "absent": self.absent, "cost_us": round(self.cost_us, 1)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Residence":
        """Back from to_dict (an event, the self-test job's evidence); ValueError/KeyError when not one."""
        return cls(str(d["what"]), tuple(int(n) for n in d["planned"]),
                   {int(k): int(v) for k, v in d["by_node"].items()}, ResidenceSource(d["source"]),
                   int(d.get("asked", 0)), int(d.get("absent", 0)), float(d.get("cost_us", 0.0)))


def _tally(statuses: Iterable[int]) -> tuple[dict[int, int], int]:
    by_node: dict[int, int] = {}
    absent = 0
    for s in statuses:
        if s >= 0:
            by_node[s] = by_node.get(s, 0) + 1
        else:  # -ENOENT: no page there; -EFAULT: not mapped (a buffer freed meanwhile)
            absent += 1
    return by_node, absent


def spread(ranges: Sequence[tuple[int, int]], pages: int) -> list[int]:
    """`pages` page-aligned addresses spread evenly over the (start, end) ranges taken end to end
    (each range gets a share in proportion to its size; every range of at least one page is
    asked at least once when there are fewer ranges than pages)."""
    ranges = [(lo & ~(PAGE - 1), hi) for lo, hi in ranges if hi - (lo & ~(PAGE - 1)) >= PAGE]
    total = sum((hi - lo) // PAGE for lo, hi in ranges)
    if total <= pages:
        return [a for lo, hi in ranges for a in range(lo, hi - PAGE + 1, PAGE)]
    stride = total / pages
    out: list[int] = []
    base = 0  # pages before the current range
    for lo, hi in ranges:
        n = (hi - lo) // PAGE
        # samples k sit at (k + 0.5) x stride pages from the start of the first range
        k0, k1 = math.ceil(base / stride - 0.5), math.ceil((base + n) / stride - 0.5)
        out.extend([lo + int((k + 0.5) * stride - base) * PAGE for k in range(k0, min(k1, pages))])
        base += n
    return out


def sample_process(planned: Iterable[int], *, pid: int = 0, pages: int = SAMPLE_PAGES, proc: str = "/proc",
                   query: Optional[Query] = None) -> Residence:
    """The process's anonymous data pages, sampled (pid 0: this process). Raises OSError when
    maps or move_pages cannot be read (another user's process, an unknown arch), ThreadGone."""
    t0 = time.perf_counter_ns()
    entries = _procfs.maps("self" if pid == 0 else pid, proc)
    addresses = spread([(e.start, e.end) for e in entries if e.anon_data], pages)
    statuses = (query or (lambda a: _procfs.move_pages_query(a, pid)))(addresses)
    by_node, absent = _tally(statuses)
    return Residence("process", tuple(sorted(set(planned))), by_node, ResidenceSource.MOVE_PAGES, len(addresses),
                     absent, (time.perf_counter_ns() - t0) / 1e3)


def read_process(planned: Iterable[int], *, pid: int = 0, proc: str = "/proc") -> Residence:
    """Every anonymous page of the process, counted from numa_maps (see the module docstring:
    costly on a big process; not for the periodic watch)."""
    t0 = time.perf_counter_ns()
    entries = _procfs.numa_maps("self" if pid == 0 else pid, proc)
    by_node: dict[int, int] = {}
    for e in entries:
        if e.anon_data:
            for node, n in e.pages.items():  # in 4 KiB pages, so huge pages weigh what they hold
                by_node[node] = by_node.get(node, 0) + n * e.page_kb // 4
    return Residence("process", tuple(sorted(set(planned))), by_node, ResidenceSource.NUMA_MAPS,
                     sum(by_node.values()), 0, (time.perf_counter_ns() - t0) / 1e3)


def sample_buffers(what: str, buffers: Sequence[tuple[int, int]], planned: Iterable[int], *,
                   pages: int = SAMPLE_PAGES, query: Optional[Query] = None) -> Residence:
    """Pages of given buffers ((address, bytes) each: a batch's tensors), asked with move_pages."""
    t0 = time.perf_counter_ns()
    addresses = spread([(a, a + n) for a, n in buffers if n > 0], pages)
    statuses = (query or _procfs.move_pages_query)(addresses)
    by_node, absent = _tally(statuses)
    return Residence(what, tuple(sorted(set(planned))), by_node, ResidenceSource.MOVE_PAGES, len(addresses),
                     absent, (time.perf_counter_ns() - t0) / 1e3)


def tensor_buffers(batch: Any, limit: int = 256) -> tuple[list[tuple[int, int]], bool]:
    """(address, bytes) of the CPU tensors in a batch (tensors, or lists, tuples, dicts of them,
    as a DataLoader's collate makes), and whether they are pinned; at most `limit` tensors."""
    out: list[tuple[int, int]] = []
    pinned = False
    stack = [batch]
    while stack and len(out) < limit:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif hasattr(x, "data_ptr") and hasattr(x, "untyped_storage") and getattr(x, "is_cpu", False):
            try:
                out.append((x.data_ptr(), x.numel() * x.element_size()))
                pinned = pinned or bool(x.is_pinned())
            except RuntimeError:  # a sparse or meta tensor has no storage to ask about
                continue
    return out, pinned


def below(res: Residence, min_pct: float) -> Optional[str]:
    """The warning to give when the share on the planned nodes is under `min_pct`, naming where
    the other pages are; None when it is not (or cannot be told)."""
    share = res.share_pct
    if share is None or share >= min_pct:
        return None
    return (f"memory residence {share:.1f}% below {min_pct:g}%: {res.describe()}; pages off the planned node "
            f"cost remote-memory bandwidth (touched before binding, or reused from a cache filled on another node)")


def planned_nodes(mode: str, nodes: Sequence[int]) -> tuple[int, ...]:
    """The nodes a rank's pages should sit on under a policy: none for the kernel's default."""
    return () if mode in ("none", "local") else tuple(sorted(set(nodes)))


def safe(reader: Callable[[], Residence]) -> tuple[Optional[Residence], Optional[str]]:
    """(residence, None) or (None, one-line reason): a look that cannot be made never raises."""
    try:
        return reader(), None
    except _procfs.ThreadGone:
        return None, "the process exited"
    except OSError as e:
        code = errno.errorcode.get(e.errno, e.errno) if e.errno else type(e).__name__
        return None, f"{code}: {e.strerror or e}"
    except ValueError as e:
        return None, f"not understood: {e}"
