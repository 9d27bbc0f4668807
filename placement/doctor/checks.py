"""The host checks of `placement doctor`: each a pure function of the gathered facts -> Check.

A check that cannot read what it needs says `unknown`, never `pass`. Severity is how much the
problem costs a training job when present; status is what was found on this host.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from placement.cpuset import format_cpulist
from placement.doctor.facts import Interrupt, RunningRank, RunningRanks, SmtState, TurboState
from placement.plan.model import Plan
from placement.roles import HOT_ROLES, ThreadRole
from placement.topology.model import PATH_CLASSES, Gpu, Topology

STATUSES = ("pass", "warn", "unknown", "info", "n/a")
SEVERITIES = ("high", "medium", "low", "info")


@dataclass
class Check:
    name: str
    status: str  # one of STATUSES
    severity: str  # one of SEVERITIES
    summary: str  # one line: what was found
    evidence: list[str] = field(default_factory=list)  # the facts read, with where they came from
    fix: Optional[str] = None  # the command or setting a user would apply


@dataclass
class Facts:
    """Everything the checks read, gathered once (placement.doctor.command.gather)."""

    topology: Topology
    live: bool  # reading the running host (root "/"), not a gathered tree
    governors: Optional[dict[int, str]] = None
    turbo: Optional[TurboState] = None
    smt: Optional[SmtState] = None
    irqs: Optional[dict[int, frozenset[int]]] = None
    interrupts: dict[int, Interrupt] = field(default_factory=dict)
    irqbalance: Optional[list[int]] = None
    nvlink: Optional[set[frozenset[str]]] = None  # GPU pairs by PCI id with NVLink P2P
    plan: Optional[Plan] = None  # the plan for every GPU of the node (hot cores, cpuset size)
    plan_error: Optional[str] = None
    libnuma_error: Optional[str] = None  # live host: why placement cannot apply a memory policy (py-libnuma)
    running: Optional[RunningRanks] = None  # live host: placement ranks running now, with their residence
    residence_min_pct: float = 90.0  # monitor.residence_min_pct: the share below which residence is a problem


def numa_balancing(f: Facts) -> Check:
    name, sev = "numa_balancing", "high"
    value = f.topology.kernel.numa_balancing
    ev = [f"proc/sys/kernel/numa_balancing = {value}"]
    if value is None:
        return Check(name, "unknown", sev, "cannot read proc/sys/kernel/numa_balancing")
    if value == 0:
        return Check(name, "pass", sev, "automatic NUMA balancing is off", ev)
    if len(f.topology.numa_nodes) <= 1:
        return Check(name, "pass", sev, "NUMA balancing is on but there is one node: nothing to migrate", ev)
    return Check(name, "warn", sev,
                 "automatic NUMA balancing is on: the kernel migrates pages and threads of bound ranks "
                 "(latency spikes, bursts of minor faults)", ev,
                 "sudo sysctl -w kernel.numa_balancing=0  # persist: echo kernel.numa_balancing=0 | "
                 "sudo tee /etc/sysctl.d/90-numa-balancing.conf")


def cpu_governor(f: Facts) -> Check:
    name, sev = "cpu_governor", "medium"
    if f.governors is None:
        return Check(name, "unknown", sev, "no CPU exposes cpufreq/scaling_governor (VM or container?)")
    counts = Counter(f.governors.values())
    ev = [f"cpufreq/scaling_governor: {g} on CPUs {format_cpulist(c for c, v in f.governors.items() if v == g)}"
          for g in sorted(counts)]
    if set(counts) == {"performance"}:
        return Check(name, "pass", sev, "every CPU runs the performance governor", ev)
    return Check(name, "warn", sev,
                 f"governor is not performance on {sum(n for g, n in counts.items() if g != 'performance')} "
                 "CPUs: hot threads wait for the clock to ramp up", ev,
                 "sudo cpupower frequency-set -g performance")


def turbo(f: Facts) -> Check:
    name, sev = "turbo", "medium"
    if f.turbo is None:
        return Check(name, "unknown", sev, "no intel_pstate/no_turbo or cpufreq/boost file to read")
    ev = [f"{f.turbo.path} says turbo {'on' if f.turbo.enabled else 'off'}"]
    if f.turbo.enabled:
        return Check(name, "pass", sev, "turbo/boost is on", ev)
    return Check(name, "warn", sev, "turbo/boost is off: the fastest cores run at base clock", ev, f.turbo.fix)


def offline_cpus(f: Facts) -> Check:
    name, sev = "offline_cpus", "low"
    if not f.topology.cpus:
        return Check(name, "unknown", sev, "the topology lists no CPUs")
    off = sorted(c.id for c in f.topology.cpus if not c.online)
    if not off:
        return Check(name, "pass", sev, f"all {len(f.topology.cpus)} CPUs are online")
    return Check(name, "warn", sev, f"{len(off)} CPUs are offline and cannot be planned",
                 [f"offline CPUs: {format_cpulist(off)}"],
                 f"for c in {' '.join(map(str, off[:8]))}{' ...' if len(off) > 8 else ''}; do "
                 "echo 1 | sudo tee /sys/devices/system/cpu/cpu$c/online; done")


def smt(f: Facts) -> Check:
    name, sev = "smt", "info"
    cores = f.topology.groups("core")
    per_core = Counter(len(v) for v in cores.values())
    ev = []
    if f.smt is not None:
        ev.append(f"sys/devices/system/cpu/smt/control = {f.smt.control}, active = {f.smt.active}")
    if per_core:
        ev.append("threads per core: " + ", ".join(f"{n} ({k} cores)" for n, k in sorted(per_core.items())))
    if not ev:
        return Check(name, "unknown", sev, "neither smt/control nor core siblings are readable")
    on = (f.smt.active if f.smt is not None and f.smt.active is not None else max(per_core, default=1) > 1)
    if on:
        return Check(name, "info", sev, "SMT is on: with smt=avoid hot roles get a whole core, siblings stay idle",
                     ev, "to turn SMT off: echo off | sudo tee /sys/devices/system/cpu/smt/control")
    return Check(name, "info", sev, "SMT is off or absent: one thread per core", ev)


def membind(f: Facts) -> Check:
    name, sev = "membind", "high"
    allowed = f.topology.kernel.membind_allowed
    if allowed is None:
        why = "probed on the live host only" if not f.live else "the probe could not run"
        return Check(name, "unknown", sev, f"whether membind is allowed is unknown ({why})")
    if allowed and f.libnuma_error:
        return Check(name, "warn", sev, "membind is allowed by the kernel but placement cannot apply it: "
                     "memory stays unbound", [f"probe: set_mempolicy(MPOL_BIND) succeeded; {f.libnuma_error}"],
                     "pip install py-libnuma and install libnuma1 (Debian/Ubuntu) or numactl-libs (RHEL)")
    if allowed:
        return Check(name, "pass", sev, "set_mempolicy(MPOL_BIND) is allowed",
                     ["probe: set_mempolicy(MPOL_BIND) to this process's Mems_allowed nodes succeeded"])
    return Check(name, "warn", sev,
                 "membind is refused (container): memory falls back to preferred or none and reads may go "
                 "to the remote socket", ["probe: set_mempolicy(MPOL_BIND) to this process's Mems_allowed nodes was refused"],
                 "run the container with the CPU manager static policy and topology manager "
                 "single-numa-node (Kubernetes) or --cpuset-mems matching its CPUs (docker); until then "
                 "run with placement.memory=preferred")


def cpuset_size(f: Facts) -> Check:
    name, sev = "cpuset_size", "high"
    topo = f.topology
    if not topo.gpus:
        return Check(name, "n/a", sev, "no GPU on this host")
    usable = topo.usable()
    online = frozenset(c.id for c in topo.cpus if c.online)
    cores = topo.groups("core", within=usable)
    ev = [f"usable CPUs (online, in the cpuset): {len(usable)} of {len(online)} online "
          f"({format_cpulist(usable)}), {len(cores)} whole cores, for {len(topo.gpus)} GPUs"]
    restricted = usable != online
    if f.plan_error is not None:
        what = "the cpuset is too small" if restricted else "too few usable cores"
        return Check(name, "warn", sev, f"{what} for one rank per GPU: {f.plan_error}", ev,
                     "give the job more CPUs (Slurm: --cpus-per-task; Kubernetes: resources.requests.cpu "
                     "with the static CPU manager); placerun runs a degraded plan meanwhile (placement.strict=true refuses it)")
    if f.plan is None:
        return Check(name, "unknown", sev, "no plan to compare the cpuset with", ev)
    return Check(name, "pass", sev,
                 ("the cpuset is restricted but holds a plan for" if restricted else "no cpuset restriction; a plan fits")
                 + f" {len(f.plan.ranks)} ranks", ev)


def _nearest_nic(gpu: Gpu) -> Optional[str]:
    if gpu.nic_paths:
        return min(gpu.nic_paths, key=lambda n: (PATH_CLASSES.index(gpu.nic_paths[n])
                                                 if gpu.nic_paths[n] in PATH_CLASSES else len(PATH_CLASSES), n))
    return gpu.nics[0] if gpu.nics else None


def gpu_nic_locality(f: Facts) -> Check:
    name, sev = "gpu_nic_locality", "high"
    topo = f.topology
    if not topo.gpus or not topo.nics:
        return Check(name, "n/a", sev, "no GPU" if not topo.gpus else "no NIC on this host")
    nics = {n.name: n for n in topo.nics}
    crossed, unknown, ev = [], [], []
    for g in topo.gpus:
        nic = nics.get(_nearest_nic(g) or "")
        if nic is None:
            unknown.append(g.index)
            continue
        path = g.nic_paths.get(nic.name, "?")
        line = f"GPU {g.index} ({g.pci}, node {g.numa}) -> nearest NIC {nic.name} ({nic.pci}, node {nic.numa}, {path})"
        ev.append(line)
        if g.numa is None or nic.numa is None:
            unknown.append(g.index)
        elif g.numa != nic.numa:
            crossed.append((g, nic))
    if crossed:
        pairs = ", ".join(f"GPU {g.index} (node {g.numa}) / {n.name} (node {n.numa})" for g, n in crossed)
        ev = [e for e in ev if any(e.startswith(f"GPU {g.index} ") for g, _ in crossed)]
        for r in (f.plan.ranks if f.plan is not None else []):
            if r.gpu is not None and any(r.gpu.index == g.index for g, _ in crossed) and r.cpus(ThreadRole.NCCL):
                ev.append(f"plan: local rank {r.local_rank} (GPU {r.gpu.index}) runs its NCCL threads on CPUs "
                          f"{format_cpulist(r.cpus(ThreadRole.NCCL))}")
        return Check(name, "warn", sev,
                     f"GPU and its nearest NIC on different NUMA nodes: {pairs}; GPUDirect RDMA and the "
                     "NCCL proxy cross the socket link", ev,
                     "placerun puts these ranks' NCCL threads on the NIC's node; check `nvidia-smi topo -m` "
                     "and put the NIC in a slot of the GPU's socket, or list a GPU-local NIC first in NCCL_IB_HCA")
    if unknown:
        return Check(name, "unknown", sev, f"NUMA node of GPU or NIC unknown for GPUs {unknown}", ev)
    return Check(name, "pass", sev, "every GPU's nearest NIC is on the GPU's NUMA node", ev)


def gpu_pair_sys(f: Facts) -> Check:
    name, sev = "gpu_pair_sys", "medium"
    gpus = f.topology.gpus
    if len(gpus) < 2:
        return Check(name, "n/a", sev, "fewer than two GPUs")
    if any(g.numa is None for g in gpus):
        return Check(name, "unknown", sev, "the NUMA node of some GPU is unknown",
                     [f"GPU {g.index} ({g.pci}) node {g.numa}" for g in gpus])
    sys_pairs = [(a, b) for a, b in itertools.combinations(gpus, 2) if a.numa != b.numa]
    if not sys_pairs:
        return Check(name, "pass", sev, "all GPUs share one NUMA node: no pair meets through SYS")
    ev = [f"{len(sys_pairs)} GPU pairs on different NUMA nodes (SYS), e.g. "
          + ", ".join(f"{a.index}-{b.index}" for a, b in sys_pairs[:6])]
    if f.nvlink is None:
        why = "NVML is not available" if f.live else "NVLink state is read from NVML on the live host only"
        return Check(name, "unknown", sev, f"GPU pairs meet through SYS; whether NVLink joins them is unknown ({why})", ev)
    bare = [(a, b) for a, b in sys_pairs if frozenset((a.pci, b.pci)) not in f.nvlink]
    if not bare:
        return Check(name, "pass", sev, "every GPU pair across NUMA nodes is joined by NVLink", ev)
    ev.append("without NVLink: " + ", ".join(f"{a.index}-{b.index}" for a, b in bare[:12]))
    return Check(name, "warn", sev,
                 f"{len(bare)} GPU pairs only meet through SYS (PCIe across sockets, no NVLink): NCCL ring "
                 "bandwidth can collapse past 16 MB messages", ev,
                 f"measure with nccl-tests: all_reduce_perf -b 1M -e 1G -f 2 -g {len(gpus)}, then again with "
                 "NCCL_BUFFSIZE=16777216 and with NCCL_MAX_NCHANNELS=4..16; keep what holds busbw past 16 MB")


def _hot_cpus(plan: Plan) -> frozenset[int]:
    out: set[int] = set()
    for r in plan.ranks:
        for role in HOT_ROLES:
            out |= r.cpus(role)
    return frozenset(out)


def irq_hot_cores(f: Facts) -> Check:
    name, sev = "irq_hot_cores", "medium"
    if f.irqs is None:
        return Check(name, "unknown", sev, "cannot list proc/irq")
    if f.plan is None:
        return Check(name, "unknown", sev, f"no plan, so no hot cores to compare with ({f.plan_error})")
    hot = _hot_cpus(f.plan)
    if not hot:
        return Check(name, "n/a", sev, f"the plan (policy {f.plan.policy}) binds no hot role")
    online = frozenset(c.id for c in f.topology.cpus if c.online)
    cold = f.topology.usable() - hot
    # An IRQ whose affinity is every online CPU has not been steered anywhere yet, and one that
    # never fired (count 0 in /proc/interrupts) costs nothing.
    on_hot = {irq: cpus & hot for irq, cpus in f.irqs.items()
              if cpus and cpus != online and cpus & hot
              and (irq not in f.interrupts or f.interrupts[irq].count > 0)}
    ev = [f"planned hot cores (main, nccl, pin_memory): {format_cpulist(hot)}"]
    if f.irqbalance:
        ev.append(f"irqbalance running (pid {', '.join(map(str, f.irqbalance))})")
    elif f.irqbalance is not None:
        ev.append("irqbalance is not running")
    for irq, cpus in sorted(on_hot.items(), key=lambda kv: -f.interrupts[kv[0]].count if kv[0] in f.interrupts else 0)[:8]:
        i = f.interrupts.get(irq)
        ev.append(f"IRQ {irq} ({i.name if i else '?'}, {i.count if i else '?'} so far) -> CPUs {format_cpulist(cpus)}")
    ban = (f"add IRQBALANCE_BANNED_CPULIST={format_cpulist(hot)} to /etc/default/irqbalance (or /etc/sysconfig/"
           "irqbalance) and run: sudo systemctl restart irqbalance")
    if on_hot and not cold:
        return Check(name, "info", sev, f"{len(on_hot)} IRQs land on hot cores, but every usable CPU is a hot "
                     "core: there is nowhere to steer them", ev)
    if on_hot:
        irqs = " ".join(map(str, sorted(on_hot)))
        fix = ban if f.irqbalance else (f"for irq in {irqs}; do echo {format_cpulist(cold)} | "
                                        "sudo tee /proc/irq/$irq/smp_affinity_list; done")
        return Check(name, "warn", sev, f"{len(on_hot)} IRQs are delivered to planned hot cores", ev, fix)
    if f.irqbalance:
        return Check(name, "info", sev, "no IRQ on a hot core now, but irqbalance may move some there", ev, ban)
    return Check(name, "pass", sev, "no IRQ is delivered to a planned hot core", ev)


def perf_rank(f: Facts) -> Check:
    name, sev = "perf_rank", "info"
    usable = f.topology.usable()
    ranks = {c.id: c.perf_rank for c in f.topology.cpus if c.id in usable and c.perf_rank is not None}
    if not ranks:
        return Check(name, "unknown", sev, "no perf_rank evidence (CPPC highest_perf, prefcore, cpufreq)")
    by_rank: dict[int, list[int]] = {}
    for cpu, r in ranks.items():
        by_rank.setdefault(r, []).append(cpu)
    sst = ("on Intel Xeon, SST-TF / SST-BF raise chosen cores: sudo intel-speed-select turbo-freq enable "
           "(or base-freq enable), then the fastest are used for hot threads")
    ev = [f"perf_rank {r}: CPUs {format_cpulist(c)}" for r, c in sorted(by_rank.items())[:4]]
    if len(by_rank) == 1:
        return Check(name, "info", sev, "all usable cores have the same perf_rank", ev, sst)
    return Check(name, "info", sev,
                 f"cores differ in expected peak ({len(by_rank)} perf ranks): the fastest "
                 f"({format_cpulist(by_rank[min(by_rank)])}) are used for hot threads", ev, sst)


SUMMARY_RANKS = 4  # ranks named one by one in the summary; more are summed up (all are in the evidence)


def _who(r: RunningRank) -> str:
    return f"rank {r.rank if r.rank is not None else '?'} (pid {r.pid})"


def _rest(r: RunningRank) -> str:
    return ", ".join(f"{pct:.1f}% on node {node}" for node, pct in r.residence.elsewhere().items())


def memory_residence(f: Facts) -> Check:
    """Where the pages of the placement ranks running now sit, against their plan's memory nodes
    (residence.py: a move_pages sample by pid, the periodic watch's reader)."""
    name, sev = "memory_residence", "medium"
    if f.running is None:
        return Check(name, "n/a", sev, "running ranks are sampled on the live host only")
    unread = f.running.unreadable
    unread_line = (f"{len(unread)} of your processes could not be read, so a rank among them is not seen: pids "
                   + ", ".join(f"{pid} ({why})" for pid, why in sorted(unread.items())[:8])
                   + (" ..." if len(unread) > 8 else "")) if unread else None
    if not f.running.ranks:
        if unread:  # said, not judged: pid 1 of a container, non-dumpable daemons are never ranks
            return Check(name, "info", sev, "no placement rank is running among the processes that could be read",
                         [unread_line])
        return Check(name, "n/a", sev, "no placement rank is running (started by placerun: PLACEMENT_PLAN_FILE "
                     "in its environment)")
    min_pct = f.residence_min_pct
    ev, low, measured, parts = [], [], [], []
    for r in f.running.ranks:
        res = r.residence
        if res is None:
            ev.append(f"{_who(r)}: not sampled: {r.null}")
            parts.append(f"{_who(r)} not sampled")
            continue
        ev.append(f"{_who(r)}, memory policy {r.memory_mode}: {res.describe()}")
        share = res.share_pct
        if share is None:
            parts.append(f"{_who(r)} no node planned" if res.resident else f"{_who(r)} no resident page seen")
            continue
        measured.append(share)
        rest = _rest(r)
        parts.append(f"{_who(r)} {share:.1f}% on node {format_cpulist(res.planned)}" + (f" ({rest})" if rest else ""))
        if share < min_pct:
            low.append(r)
    if unread_line:
        ev.append(unread_line)
    n = len(f.running.ranks)
    low_pids = {r.pid for r in low}
    if n <= SUMMARY_RANKS:
        said = "; ".join(parts)
    elif low:
        said = "; ".join(p for p, r in zip(parts, f.running.ranks) if r.pid in low_pids)
    else:
        said = f"{min(measured):.1f}% to {max(measured):.1f}% on their planned nodes" if measured else "none measured"
    head = f"{n} running rank{'s' if n > 1 else ''}"
    if low:
        moves = "; ".join(f"migratepages {r.pid} {format_cpulist(r.residence.elsewhere())} "
                          f"{format_cpulist(r.residence.planned)}" for r in low[:4])
        return Check(name, "warn", sev, f"{head}, {len(low)} below {min_pct:g}% of sampled pages on the planned "
                     f"node(s): {said}", ev,
                     f"{moves}  # numactl's migratepages moves a running rank's pages; pages touched before "
                     "binding or reused from a cache filled on another node are the usual cause (docs/monitor.md)")
    status = ("unknown" if any(r.residence is None for r in f.running.ranks) else "pass" if measured else "info")
    return Check(name, status, sev, f"{head}: {said} (threshold {min_pct:g}%)", ev)

CHECKS: tuple[Callable[[Facts], Check], ...] = (
    numa_balancing, cpu_governor, turbo, offline_cpus, smt, membind, cpuset_size,
    gpu_nic_locality, gpu_pair_sys, irq_hot_cores, perf_rank, memory_residence,
)


def run_checks(facts: Facts) -> list[Check]:
    """Every check; one that raises is reported as unknown with the error, the others still run."""
    out = []
    for check in CHECKS:
        try:
            out.append(check(facts))
        except Exception as e:  # a fact shaped unlike any host seen so far must not hide the rest
            out.append(Check(check.__name__, "unknown", "info", f"check failed: {type(e).__name__}: {e}"))
    return out
