"""Policy `auto`: per-thread-role placement (the role table of docs/plan.md).

Per node, the ranks living there split its free physical cores into equal, compact shares
(L3 groups, then clusters, kept together). Each rank needs hot cores: `main`; on a GPU rank
`backward` (torch's pt_autograd_<device> thread, which runs the CUDA backward work) on a whole
core next to main's; and `nccl` (which `pin_memory` shares) or, when NCCL goes to its NIC's node,
`pin_memory`. A CPU-only rank has no backward thread (torch starts one per non-CPU device), so
no backward role. With prefer_fast_cores the ranks then trade cores until the node's hot cores
are its fastest ones: a slow hot core is swapped for a faster non-hot core of any rank.

L3 rule: a trade with another rank whose core sits in another L3 group costs both ranks their
L3-compact share (each then spans two L3 groups), so it is made only when the faster core is
expected to be at least L3_TRADE_MIN_GAIN (10%) faster on the evidence perf_rank comes from
(CPPC highest_perf, prefcore ranking, max frequency); where every core has its own rank
(amd-pstate prefcore, ITMT) the few-percent steps between neighbours do not pay for it, while a
favoured core that is really faster (a P-core, a boosted CCD) still does. Trades inside an L3
group, or within the rank's own share, take any gain. What is left of a share is `other`;
`dataloader` is a part of it spread over L3/cluster groups, one core per expected worker.
"""
from __future__ import annotations

import dataclasses
from itertools import chain, zip_longest

from placement.config import Policy
from placement.cpuset import format_cpulist
from placement.plan.context import PlanContext, RankSlot
from placement.plan.cores import Core, physical_cores, threads_of
from placement.plan.gpus import attach_nics
from placement.plan.memory import memory_policy
from placement.plan.model import GpuRef, JobSpec, RankPlan, RoleAssignment
from placement.plan.nodes import assign_nodes
from placement.plan.process_level import plan_process_level
from placement.roles import ThreadRole

# A trade of a hot core for another rank's core in another L3 group needs this expected gain.
L3_TRADE_MIN_GAIN = 0.10


def hot_cores_needed(s: RankSlot) -> int:
    """main, backward (GPU ranks only), and nccl (shared with pin_memory) or pin_memory."""
    return 3 if s.gpu is not None else 2


def plan_auto(ctx: PlanContext, slots: list[RankSlot], job: JobSpec) -> list[RankPlan]:
    cores = physical_cores(ctx.topo, ctx.usable)
    by_node: dict[int, list[Core]] = {}
    for c in cores:
        by_node.setdefault(c.node, []).append(c)
    if len(slots) > len(cores):
        ctx.shortfall(
            f"nproc_per_node={len(slots)} needs one free physical core per rank but only {len(cores)} "
            f"are free (CPUs {format_cpulist(ctx.usable)}{_reserved_note(ctx)})",
            "ranks share physical cores, so their hot threads compete")
    assign_nodes(ctx, slots, by_node, relieve_crowded=True)
    for s in slots:
        attach_nics(ctx, s)
    remote_nccl = _reserve_nic_cores(ctx, slots, by_node)
    taken = set(remote_nccl.values())
    plans: dict[int, RankPlan] = {}
    for node in sorted({s.node for s in slots}):
        members = [s for s in slots if s.node == node]
        pool = [c for c in by_node[node] if c not in taken]
        shares, hot = _split_node(ctx, node, pool, members)
        for s, share, hot_cores in zip(members, shares, hot):
            plans[s.local_rank] = _rank_plan(ctx, s, share, hot_cores, remote_nccl.get(s.local_rank), job)
    return [plans[s.local_rank] for s in slots]


def plan_auto_within(ctx: PlanContext, slots: list[RankSlot], job: JobSpec, mode: Policy) -> list[RankPlan]:
    """Per-role plans inside the CPU sets of torchrun's --numa-binding=`mode` (the process-level
    policy of that name computes them as torch does): ranks given the same set split its cores
    into compact shares as `auto` splits a node, and each share gets auto's roles. So every
    thread of a rank stays inside the set torch would bind it to; NICs on another node are not
    used for nccl (that core would be outside the set)."""
    outer_ctx = dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, policy=mode))
    outer = plan_process_level(outer_ctx, slots, job)  # warns into ctx.warnings (the same list)
    groups: dict[frozenset[int], list[RankSlot]] = {}
    for s, rank in zip(slots, outer):
        groups.setdefault(rank.share(), []).append(s)
    plans: dict[int, RankPlan] = {}
    for envelope, members in groups.items():
        pool = physical_cores(ctx.topo, envelope)
        shares, hot = _split_node(ctx, members[0].node, pool, members)
        inside = f"; inside torchrun --numa-binding={mode}'s set CPUs {format_cpulist(envelope)}"
        for s, share, hot_cores in zip(members, shares, hot):
            p = _rank_plan(ctx, s, share, hot_cores, None, job)
            nodes = sorted({c.node for c in share})
            p.numa, p.memory = nodes, memory_policy(ctx, nodes)
            p.roles = {role: RoleAssignment(a.cpus, a.reason + inside) for role, a in p.roles.items()}
            plans[s.local_rank] = p
    return [plans[s.local_rank] for s in slots]


def _reserved_note(ctx: PlanContext) -> str:
    return f", reserved {format_cpulist(ctx.reserved)}" if ctx.reserved else ""


def _reserve_nic_cores(ctx: PlanContext, slots: list[RankSlot], by_node: dict[int, list[Core]]) -> dict[int, Core]:
    """For ranks whose GPU's NIC sits on another node, take that node's fastest free core for
    nccl, when the node keeps two cores for each of its own ranks."""
    prefer_fast = ctx.cfg.prefer_fast_cores
    out: dict[int, Core] = {}
    for s in slots:
        m = s.nic_node
        if m is None:
            continue
        own = sum(hot_cores_needed(t) for t in slots if t.node == m)
        free = [c for c in by_node.get(m, []) if c not in out.values()]
        if len(free) - 1 < own:
            ctx.warn(f"NIC {s.nic} of GPU {s.gpu.index} is on node {m}, which has no spare core; "
                     f"local rank {s.local_rank}'s nccl stays on node {s.node} (GPU's node)")
            s.nic_node = None
            continue
        out[s.local_rank] = min(free, key=lambda c: c.hot_order(prefer_fast))
    return out


def _split_node(ctx: PlanContext, node: int, pool: list[Core], members: list[RankSlot]
                ) -> tuple[list[list[Core]], list[list[Core]]]:
    """Equal compact shares of the node's free cores, and each share's hot cores."""
    k, count = len(members), len(pool)
    prefer_fast = ctx.cfg.prefer_fast_cores
    if count >= k:
        base, extra = divmod(count, k)
        shares, start = [], 0
        for i in range(k):
            size = base + (1 if i < extra else 0)
            shares.append(pool[start:start + size])
            start += size
    else:
        shares = [[pool[i % count]] for i in range(k)]
        ctx.warn(f"node {node} has {count} free physical core(s) for {k} ranks: local ranks "
                 f"{', '.join(str(s.local_rank) for s in members)} share cores, hot threads of "
                 "different ranks compete")
    hot = [_hot_cores(sh, prefer_fast, hot_cores_needed(s)) for s, sh in zip(members, shares)]
    if prefer_fast and count >= k:
        _trade_for_speed(shares, hot)
    return shares, hot


def _hot_cores(share: list[Core], prefer_fast: bool, count: int) -> list[Core]:
    """The share's `count` hot cores in hot order, each on an AMD compute unit the others do not use
    when one is as fast (two cores of a unit share one front end, so main and nccl would compete)."""
    ranked = sorted(share, key=lambda c: c.hot_order(prefer_fast))
    picked: list[Core] = []
    for _ in range(min(count, len(ranked))):
        rest = [c for c in ranked if c not in picked]
        speed = rest[0].hot_order(prefer_fast)[:2]  # (not whole, perf_rank or 0)
        units = {c.compute_unit for c in picked}
        apart = [c for c in rest if c.compute_unit not in units and c.hot_order(prefer_fast)[:2] == speed]
        picked.append(apart[0] if apart else rest[0])
    return picked


def _speed(c: Core) -> tuple[bool, int]:
    return (not c.whole, c.perf)


def trade_pays(hot: Core, candidate: Core, same_share: bool) -> bool:
    """Whether `candidate` may replace the hot core `hot` (the L3 rule of the module doc)."""
    if _speed(candidate) >= _speed(hot):
        return False
    if same_share or candidate.l3 == hot.l3 or candidate.whole != hot.whole:
        return True  # no locality lost, or a whole core for one with a housekeeping sibling
    gain = candidate.gain_over(hot)
    return gain is not None and gain >= L3_TRADE_MIN_GAIN


def _trade_for_speed(shares: list[list[Core]], hot: list[list[Core]]) -> None:
    """Swap the slowest hot core for the fastest non-hot core that is faster and that the L3 rule
    lets it take, while there is one. Each swap lowers the hot cores' total speed key, so this
    ends; at the end every non-hot core faster than a hot core is one the L3 rule keeps apart."""
    while True:
        hot_all = sorted(((i, a) for i, h in enumerate(hot) for a in h),
                         key=lambda t: (_speed(t[1]), t[1].compact_order), reverse=True)
        rest_all = [(j, b) for j, sh in enumerate(shares) for b in sh if b not in hot[j]]
        swap = None
        for i, a in hot_all:
            allowed = [(j, b) for j, b in rest_all if trade_pays(a, b, i == j)]
            if allowed:
                j, b = min(allowed, key=lambda t: (_speed(t[1]), t[1].l3 != a.l3, t[1].compact_order))
                swap = (i, a, j, b)
                break
        if swap is None:
            return
        i, a, j, b = swap
        hot[i][hot[i].index(a)] = b
        shares[j].remove(b)
        shares[i].remove(a)
        shares[i].append(b)
        shares[j].append(a)
        for sh in (shares[i], shares[j]):
            sh.sort(key=lambda c: c.compact_order)


def _backward_core(main: Core, hot: list[Core]) -> tuple[Core, list[Core]]:
    """The backward thread's core and the hot cores left for nccl/pin_memory: a core of its own
    next to main's (same L3, then cluster) when the rank has three hot cores, else main's."""
    if len(hot) < 3:
        return main, hot
    near = min(hot[1:], key=lambda c: (c.l3 != main.l3, c.cluster != main.cluster, hot.index(c)))
    return near, [c for c in hot if c is not near]


def _spread(cores: list[Core], n: int) -> list[Core]:
    """n cores dealt round-robin over L3 groups (largest first), and over clusters within each."""
    l3s: dict[int, dict[int, list[Core]]] = {}
    for c in cores:
        l3s.setdefault(c.l3, {}).setdefault(c.cluster, []).append(c)
    per_l3 = []
    for clusters in sorted(l3s.values(), key=lambda cl: (-sum(map(len, cl.values())), min(cl))):
        per_l3.append([c for c in chain(*zip_longest(*clusters.values())) if c is not None])
    dealt = [c for c in chain(*zip_longest(*per_l3)) if c is not None]
    return dealt[:n]


def intra_op_threads(cpu_only: bool, main: list[int], other: list[int]) -> int:
    """The rank's OMP_NUM_THREADS: its `other` CPUs; for a CPU-only rank, whose model runs on torch's
    intra-op pool (the calling thread, main, is its first thread, aten/src/ATen/ParallelOpenMP.h),
    main's CPUs too, so that placed it computes on as many cores as torchrun leaves it (torchrun
    sets OMP_NUM_THREADS=1 only when it starts several processes, torch/distributed/run.py)."""
    return len(set(other) | set(main)) if cpu_only else len(other)


def _rank_plan(ctx: PlanContext, s: RankSlot, share: list[Core], hot: list[Core], remote: Core | None,
               job: JobSpec) -> RankPlan:
    smt = ctx.cfg.smt
    prefer_fast = ctx.cfg.prefer_fast_cores
    hot = sorted(hot, key=lambda c: c.hot_order(prefer_fast))
    main = hot[0]
    rest = [c for c in share if c not in hot]
    node, r = s.node, s.local_rank
    where = f"on node {node}, {s.why_node}"
    speed = "fastest" if prefer_fast else "first"
    fast_note = "" if prefer_fast else ", prefer_fast_cores off"
    roles: dict[ThreadRole, RoleAssignment] = {}
    roles[ThreadRole.MAIN] = RoleAssignment(
        sorted(main.use(smt)),
        f"{speed} whole core of local rank {r}'s share (core {main.key}, {main.describe_perf()}{fast_note}) {where}")
    if s.gpu is not None:
        backward, hot = _backward_core(main, hot)
        roles[ThreadRole.BACKWARD] = RoleAssignment(sorted(backward.use(smt)), (
            f"whole core {backward.key} next to main's ({backward.describe_perf()}; "
            f"{'same L3' if backward.l3 == main.l3 else 'another L3'}): torch's autograd thread for GPU "
            f"{s.gpu.index} (pt_autograd_<device>) runs its backward work while main waits in backward()" if backward is not main else
            f"shares main's core {main.key} (local rank {r} has too few cores for its own): main waits in "
            "backward() while pt_autograd runs, so the two take turns"))
    second = hot[1] if len(hot) > 1 else None
    if remote is not None:
        roles[ThreadRole.NCCL] = RoleAssignment(
            sorted(remote.use(smt)),
            f"{speed} free whole core of node {remote.node}, the node of NIC {s.nic} (core {remote.key}, "
            f"{remote.describe_perf()}); GPU {s.gpu.index} sits on node {node}")
        pin = second or main
        if second is None:
            ctx.warn(f"local rank {r} has one free physical core on node {node} (core {main.key}): "
                     "pin_memory shares main's core")
        roles[ThreadRole.PIN_MEMORY] = RoleAssignment(
            sorted(pin.use(smt)),
            f"core {pin.key} next to main on node {node} (nccl is on NIC {s.nic}'s node {remote.node})")
    else:
        nccl = second or main
        nic = f"; NIC {s.nic} is on this node" if s.nic else ""
        if second is None:
            ctx.warn(f"local rank {r} has one free physical core on node {node} (core {main.key}): "
                     "all its roles share it")
            nccl_reason = pin_reason = f"shares main's core {main.key}: local rank {r} has one free core on node {node}"
        else:
            nccl_reason = (f"next {speed} whole core (core {nccl.key}, {nccl.describe_perf()}) on node {node}, "
                           f"{s.why_node}{nic}")
            pin_reason = f"shares nccl's core {nccl.key}, next to main on node {node} (pin-memory copies are light)"
        roles[ThreadRole.NCCL] = RoleAssignment(sorted(nccl.use(smt)), nccl_reason)
        roles[ThreadRole.PIN_MEMORY] = RoleAssignment(sorted(nccl.use(smt)), pin_reason)
    if rest:
        other = threads_of(rest, smt)
        workers = job.dataloader_workers
        picked = _spread(rest, workers) if workers > 0 else rest
        groups = len({c.l3 for c in picked})
        dl_reason = (f"{len(picked)} of local rank {r}'s {len(rest)} non-hot cores for {workers} DataLoader "
                     f"worker(s), spread over {groups} L3 group(s) of node {node}" if workers > 0 else
                     f"no DataLoader workers expected: all {len(rest)} non-hot cores of local rank {r}'s share")
        dataloader = threads_of(picked, smt)
        other_reason = f"local rank {r}'s share on node {node} minus its hot cores: {len(rest)} core(s)"
    else:
        spare = second or main
        other = dataloader = spare.use(smt)
        role = "nccl" if second is not None and remote is None else ("pin_memory" if second else "main")
        if second is not None:  # a one-core share was already announced as such
            ctx.warn(f"local rank {r} has no core beyond its hot cores on node {node}: dataloader and other "
                     f"share the {role} core {spare.key}")
        dl_reason = f"shares the {role} core {spare.key}: no core left beyond local rank {r}'s hot cores"
        other_reason = dl_reason
    threads = intra_op_threads(s.gpu is None, roles[ThreadRole.MAIN].cpus, other)
    other_reason += f", OMP_NUM_THREADS={threads}" + (" (main's core and these: a CPU-only rank computes on "
                                                      "its intra-op pool)" if threads > len(other) else "")
    roles[ThreadRole.DATALOADER] = RoleAssignment(sorted(dataloader), dl_reason)
    roles[ThreadRole.OTHER] = RoleAssignment(sorted(other), other_reason)
    nodes = sorted({node} | ({remote.node} if remote is not None else set()))
    return RankPlan(
        local_rank=r,
        gpu=None if s.gpu is None else GpuRef(s.gpu.index, s.gpu.pci),
        numa=nodes,
        memory=memory_policy(ctx, [node]),
        env={"OMP_NUM_THREADS": str(threads)},
        roles=roles,
    )
