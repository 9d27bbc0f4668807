"""Host facts `placement doctor` reads beyond the Topology, one plain function per fact.

Every path goes through `root` (default "/"), so a gathered or fixture tree is read like the live
host. A fact that cannot be read is None (never a guessed default), and nothing here needs root.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Optional, Union

from placement import _procfs
from placement import residence
from placement.cpuset import parse_cpulist
from placement.errors import PlacementError
from placement.handoff import PLAN_FILE_ENV, Handoff

CPU_DIR = "sys/devices/system/cpu"


FILE_MAX = 64 * 1024  # sysfs attributes and /proc/<pid>/comm are far smaller
INTERRUPTS_MAX = 64 * 1024 * 1024  # /proc/interrupts: one column per CPU, one line per IRQ


def _read(root: str, rel: str, limit: int = FILE_MAX) -> Optional[str]:
    """Text of a regular file under root, bounded (placement._procfs.read_bounded); None when it is
    missing, unreadable, not a regular file or too large (the check then says `unknown`)."""
    try:
        return _procfs.read_bounded(os.path.join(root, rel), limit).decode(errors="replace").replace("\x00", "").strip()
    except OSError:
        return None


def _cpu_dirs(root: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(os.path.join(root, CPU_DIR))
    except OSError:
        return []
    return sorted((int(n[3:]), f"{CPU_DIR}/{n}") for n in names if n.startswith("cpu") and n[3:].isdigit())


def governors(root: str = "/") -> Optional[dict[int, str]]:
    """scaling_governor of every CPU that exposes cpufreq; None when none does (VMs, containers)."""
    out = {}
    for cpu, d in _cpu_dirs(root):
        g = _read(root, f"{d}/cpufreq/scaling_governor")
        if g:
            out[cpu] = g
    return out or None


@dataclass(frozen=True)
class TurboState:
    path: str  # the file that says it, relative to root
    enabled: bool
    fix: str  # the command that turns it on


def turbo_state(root: str = "/") -> Optional[TurboState]:
    """Turbo/boost from intel_pstate's no_turbo or the cpufreq boost switch (acpi-cpufreq, amd-pstate)."""
    no_turbo = f"{CPU_DIR}/intel_pstate/no_turbo"
    v = _read(root, no_turbo)
    if v in ("0", "1"):
        return TurboState(no_turbo, v == "0", f"echo 0 | sudo tee /{no_turbo}")
    boost = f"{CPU_DIR}/cpufreq/boost"
    v = _read(root, boost)
    if v in ("0", "1"):
        return TurboState(boost, v == "1", f"echo 1 | sudo tee /{boost}")
    return None


@dataclass(frozen=True)
class SmtState:
    control: Optional[str]  # on | off | forceoff | notsupported | notimplemented; None: no file
    active: Optional[bool]


def smt_state(root: str = "/") -> Optional[SmtState]:
    """The kernel's SMT switch (sys/devices/system/cpu/smt/{control,active}); None without it."""
    control = _read(root, f"{CPU_DIR}/smt/control")
    active = _read(root, f"{CPU_DIR}/smt/active")
    if control is None and active is None:
        return None
    return SmtState(control or None, None if active not in ("0", "1") else active == "1")


def irq_affinities(root: str = "/") -> Optional[dict[int, frozenset[int]]]:
    """CPUs each IRQ is delivered to: effective_affinity_list where the kernel has it (what the
    hardware uses), else smp_affinity_list. None when /proc/irq cannot be listed."""
    base = os.path.join(root, "proc/irq")
    try:
        names = os.listdir(base)
    except OSError:
        return None
    out = {}
    for n in names:
        if not n.isdigit():
            continue
        for f in ("effective_affinity_list", "smp_affinity_list"):
            text = _read(root, f"proc/irq/{n}/{f}")
            if text:
                try:
                    out[int(n)] = parse_cpulist(text)
                except ValueError:
                    continue
                break
    return out


@dataclass(frozen=True)
class Interrupt:
    name: str  # the chip, trigger and device columns of /proc/interrupts, e.g. "IR-PCI-MSIX mlx5_comp3"
    count: int  # deliveries so far, summed over CPUs


def interrupts(root: str = "/") -> dict[int, Interrupt]:
    """Numbered IRQs of /proc/interrupts with their name and total count ({} when unreadable)."""
    text = _read(root, "proc/interrupts", INTERRUPTS_MAX)
    out: dict[int, Interrupt] = {}
    if not text:
        return out
    lines = text.splitlines()
    ncpu = len(lines[0].split())
    for line in lines[1:]:
        head, _, rest = line.partition(":")
        if not head.strip().isdigit():
            continue
        fields = rest.split()
        counts = [int(x) for x in fields[:ncpu] if x.isdigit()]
        out[int(head)] = Interrupt(" ".join(fields[len(counts):]), sum(counts))
    return out


def irqbalance_pids(root: str = "/") -> Optional[list[int]]:
    """PIDs of running irqbalance daemons (by comm); None when proc cannot be listed."""
    base = os.path.join(root, "proc")
    try:
        names = os.listdir(base)
    except OSError:
        return None
    return sorted(int(n) for n in names if n.isdigit() and _read(root, f"proc/{n}/comm") == "irqbalance")


def nvlink_pairs(pci_ids: list[str]) -> Optional[set[frozenset[str]]]:
    """Pairs of GPUs (by PCI bus id) that NVML says can talk peer-to-peer over NVLink, directly
    or through NVSwitch. Live host only; None when NVML does not load or cannot answer."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no NVML on this host
        return None
    try:
        handles = {pci: pynvml.nvmlDeviceGetHandleByPciBusId(pci.encode()) for pci in pci_ids}
        out = set()
        for i, a in enumerate(pci_ids):
            for b in pci_ids[i + 1:]:
                status = pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b],
                                                       pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                if status == pynvml.NVML_P2P_STATUS_OK:
                    out.add(frozenset((a, b)))
        return out
    except Exception:  # a GPU NVML does not know (MIG, filtered), or an old driver
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


@dataclass(frozen=True)
class RunningRank:
    """A placement rank running on this host now, and where its pages are."""

    pid: int
    rank: Optional[int]  # RANK from its environment
    local_rank: Optional[int]
    memory_mode: Optional[str]  # the plan's memory policy for it (None: the plan could not be read)
    residence: Optional[residence.Residence]  # sampled by pid (None: could not be, see `null`)
    null: Optional[str] = None  # one line: why the plan or the residence could not be read


@dataclass(frozen=True)
class RunningRanks:
    ranks: list[RunningRank] = field(default_factory=list)
    unreadable: dict[int, str] = field(default_factory=dict)  # pid -> why its environment could not be read


def _errno_name(e: OSError) -> str:
    return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__


def running_ranks(proc: str = "/proc", *, query: Optional[residence.Query] = None) -> RunningRanks:
    """This user's processes started by placerun (their environment holds PLACEMENT_PLAN_FILE and
    LOCAL_RANK, as the worker hook requires), each sampled by pid for where its pages are against
    its plan's memory nodes. A child of such a process (a DataLoader worker inherits the
    environment) is not a rank. A process whose status or environment cannot be read is listed
    in `unreadable` (EACCES: another user's or a more privileged process), never raised."""
    me, uid = os.getpid(), os.getuid()
    found: dict[int, tuple[int, dict[str, str]]] = {}  # pid -> (parent, environment)
    unreadable: dict[int, str] = {}
    try:
        pids = _procfs.pids(proc)
    except OSError:
        return RunningRanks()
    for pid in pids:
        if pid == me:
            continue
        try:
            owner, parent = _procfs.owner_and_parent(pid, proc)
            if owner != uid:
                continue
            env = _procfs.environ(pid, proc)
        except _procfs.ThreadGone:
            continue
        except OSError as e:
            unreadable[pid] = _errno_name(e)
            continue
        except ValueError as e:
            unreadable[pid] = f"not understood: {e}"
            continue
        if env.get(PLAN_FILE_ENV) and "LOCAL_RANK" in env:
            found[pid] = (parent, env)
    ranks = []
    handoffs: dict[str, Union[Handoff, str]] = {}  # hand-off file -> Handoff or the one-line reason it could not be read
    for pid, (parent, env) in sorted(found.items()):
        if parent in found:
            continue
        rank = int(env["RANK"]) if env.get("RANK", "").isdigit() else None
        path = env[PLAN_FILE_ENV]
        if path not in handoffs:
            try:
                handoffs[path] = Handoff.read(path)
            except PlacementError as e:
                handoffs[path] = str(e)
        handoff = handoffs[path]
        if isinstance(handoff, str):
            ranks.append(RunningRank(pid, rank, None, None, None, handoff))
            continue
        try:
            local_rank = handoff.local_rank(env)
            if local_rank is None:
                local_rank = int(env["LOCAL_RANK"])
        except (PlacementError, ValueError) as e:
            ranks.append(RunningRank(pid, rank, None, None, None, f"local rank unknown: {e}"))
            continue
        plan = handoff.plan
        try:
            memory = plan.for_local_rank(local_rank).memory
        except KeyError as e:
            ranks.append(RunningRank(pid, rank, local_rank, None, None, str(e.args[0])))
            continue
        planned = residence.planned_nodes(memory.mode, memory.nodes)
        got, why = residence.safe(lambda: residence.sample_process(planned, pid=pid, proc=proc, query=query))
        ranks.append(RunningRank(pid, rank, local_rank, str(memory.mode), got, why))
    return RunningRanks(ranks, unreadable)
