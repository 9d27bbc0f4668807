"""The rules every plan keeps (docs/design.md, "Plan"), checked against the topology it was made for.

Each check recomputes what it needs from the Topology itself (cores from the `core` key, nodes
from `numa`), not from the planner's internals, so a planner bug cannot hide in a shared helper.
"""
from __future__ import annotations

from placement.config import PlacementConfig
from placement.cpuset import parse_cpulist
from placement.plan.model import Plan
from placement.roles import HOT_ROLES, ThreadRole
from placement.topology.model import Topology


def core_of(topo: Topology) -> dict[int, int]:
    """CPU -> lowest online CPU of its physical core."""
    out = {}
    for members in topo.groups("core").values():
        for c in members:
            out[c] = min(members)
    for c in topo.cpus:
        out.setdefault(c.id, c.id)
    return out


def node_of(topo: Topology) -> dict[int, int]:
    out = {c.id: c.numa for c in topo.cpus if c.numa is not None}
    for n in topo.numa_nodes:
        for c in n.cpus:
            out.setdefault(c, n.id)
    return out


def cores(topo: Topology, cpus) -> set[int]:
    of = core_of(topo)
    return {of[c] for c in cpus}


def warned(plan: Plan, *words: str) -> bool:
    return any(all(w in msg for w in words) for msg in plan.warnings)


def check_common(topo: Topology, plan: Plan, cfg: PlacementConfig) -> None:
    """Rules of every policy: allowed and online CPUs only, never a reserved one, one-line reasons."""
    usable = topo.usable()
    reserved = parse_cpulist(cfg.reserved_cpus)
    for r in plan.ranks:
        for role, a in r.roles.items():
            cpus = set(a.cpus)
            assert cpus, f"rank {r.local_rank} role {role} has no CPU"
            assert cpus <= usable, f"rank {r.local_rank} {role} uses CPUs {sorted(cpus - usable)} not online+allowed"
            assert not cpus & reserved, f"rank {r.local_rank} {role} uses reserved CPUs {sorted(cpus & reserved)}"
            assert a.reason and "\n" not in a.reason, f"rank {r.local_rank} {role} reason {a.reason!r}"
    for w in plan.warnings:
        assert w and "\n" not in w


def check_auto(topo: Topology, plan: Plan, cfg: PlacementConfig) -> None:
    """The role rules of policy auto."""
    check_common(topo, plan, cfg)
    if not plan.ranks or not plan.ranks[0].roles:
        assert plan.warnings, "an unbound auto plan must say why"
        return
    of_core = core_of(topo)
    of_node = node_of(topo)
    threads_of_core: dict[int, set[int]] = {}
    for c in topo.cpus:
        if c.online:
            threads_of_core.setdefault(of_core[c.id], set()).add(c.id)
    shared_cores = warned(plan, "compete")  # the only warnings that let ranks share cores
    # Ranks on a node do not overlap, and a rank's hot cores are whole: no thread of them is used
    # by another rank.
    for a in plan.ranks:
        for b in plan.ranks:
            if a.local_rank >= b.local_rank:
                continue
            overlap = cores(topo, a.share()) & cores(topo, b.share())
            assert not overlap or shared_cores, (
                f"ranks {a.local_rank} and {b.local_rank} share cores {sorted(overlap)} without a warning")
    for r in plan.ranks:
        main_core = cores(topo, r.cpus(ThreadRole.MAIN))
        assert len(main_core) == 1, f"rank {r.local_rank} main spans cores {main_core}"
        nccl_core = cores(topo, r.cpus(ThreadRole.NCCL))
        pin_core = cores(topo, r.cpus(ThreadRole.PIN_MEMORY))
        assert len(nccl_core) == 1 and len(pin_core) == 1
        # backward: GPU ranks only (torch's pt_autograd_<device> exists for non-CPU devices), one
        # core, main's own only when the rank has too few cores (its reason says so)
        backward_core = cores(topo, r.cpus(ThreadRole.BACKWARD))
        if r.gpu is None:
            assert ThreadRole.BACKWARD not in r.roles, f"CPU-only rank {r.local_rank} has a backward role"
        else:
            assert len(backward_core) == 1, f"rank {r.local_rank} backward on cores {backward_core}"
            if backward_core == main_core:
                assert "shares main's core" in r.roles[ThreadRole.BACKWARD].reason
            else:
                assert not backward_core & (nccl_core | pin_core), f"rank {r.local_rank}: backward shares nccl's core"
        main_core_only = main_core
        main_core = main_core | backward_core  # the checks below treat backward as main's neighbour
        if main_core & (nccl_core | pin_core):
            assert warned(plan, f"local rank {r.local_rank} has one free physical core"), (
                f"rank {r.local_rank}: main shares its core with nccl/pin_memory without a warning")
        background = r.cpus(ThreadRole.DATALOADER) | r.cpus(ThreadRole.OTHER)
        assert r.cpus(ThreadRole.DATALOADER) <= r.cpus(ThreadRole.OTHER)
        if not (warned(plan, f"local rank {r.local_rank} has no core beyond")
                or warned(plan, f"local rank {r.local_rank} has one free physical core")):
            hot_threads = set().union(*(threads_of_core[c] for c in main_core | nccl_core | pin_core))
            assert not hot_threads & background, f"rank {r.local_rank}: background roles on hot cores"
        else:
            assert (not threads_of_core[next(iter(main_core_only))] & background
                    or warned(plan, f"local rank {r.local_rank} has one free physical core"))
        for other in plan.ranks:
            if other.local_rank != r.local_rank and not shared_cores:
                hot = set().union(*(threads_of_core[c] for c in main_core | nccl_core | pin_core))
                assert not hot & other.share(), f"rank {r.local_rank}'s hot cores used by rank {other.local_rank}"
        # Hot cores use one thread per core when SMT is avoided, every usable thread when used.
        for role in HOT_ROLES:
            cpus = r.cpus(role)
            if role not in r.roles and role is ThreadRole.BACKWARD:
                continue
            if cfg.smt == "avoid":
                assert len(cpus) == 1, f"rank {r.local_rank} {role} {sorted(cpus)}: smt=avoid gives one thread"
            else:
                core = next(iter(cores(topo, cpus)))
                assert cpus == threads_of_core[core] & topo.usable() - parse_cpulist(cfg.reserved_cpus)
        if cfg.smt == "avoid":
            per_core = {}
            for c in r.share():
                per_core.setdefault(of_core[c], set()).add(c)
            assert all(len(v) == 1 for v in per_core.values()), f"rank {r.local_rank}: two threads of a core with smt=avoid"
        # A rank never spans nodes: everything but a NIC-local nccl core is on one node.
        home = {of_node[c] for c in r.cpus(ThreadRole.MAIN)}
        assert {of_node[c] for c in r.cpus(ThreadRole.BACKWARD)} <= home, f"rank {r.local_rank} backward off main's node"
        spans = {of_node[c] for c in r.share() - r.cpus(ThreadRole.NCCL)} | home
        assert len(spans) == 1, f"rank {r.local_rank} spans nodes {sorted(spans)}"
        home_node = next(iter(home))
        nccl_nodes = {of_node[c] for c in r.cpus(ThreadRole.NCCL)}
        if nccl_nodes != home:
            gpu = next(g for g in topo.gpus if g.index == r.gpu.index)
            nic_nodes = {n.numa for n in topo.nics if n.name in gpu.nics}
            assert nccl_nodes <= nic_nodes, f"rank {r.local_rank} nccl on {nccl_nodes}, its NICs on {nic_nodes}"
        assert sorted(home | nccl_nodes) == r.numa
        if r.gpu is not None:
            gpu = next(g for g in topo.gpus if g.index == r.gpu.index)
            if gpu.numa is not None and home_node != gpu.numa:
                assert warned(plan, f"local rank {r.local_rank}") or warned(plan, f"GPU {gpu.index}'s node"), (
                    f"rank {r.local_rank} on node {home_node}, its GPU on node {gpu.numa}, no warning")
        pool = r.cpus(ThreadRole.OTHER) | (r.cpus(ThreadRole.MAIN) if r.gpu is None else set())
        assert r.env.get("OMP_NUM_THREADS") == str(len(pool))
        if r.memory.mode in ("bind", "preferred"):
            assert set(r.memory.nodes) <= {home_node} or warned(plan, "have no memory")
    check_nodes_fully_split(topo, plan, cfg)
    if cfg.prefer_fast_cores and not shared_cores:
        check_fastest_hot_cores(topo, plan, cfg)


def check_nodes_fully_split(topo: Topology, plan: Plan, cfg: PlacementConfig) -> None:
    """The ranks living on a node share out all of its usable cores (none left idle)."""
    usable = topo.usable() - parse_cpulist(cfg.reserved_cpus)
    of_node = node_of(topo)
    used: dict[int, set[int]] = {}
    homes = set()
    for r in plan.ranks:
        homes |= {of_node[c] for c in r.cpus(ThreadRole.MAIN)}
        for core in cores(topo, r.share()):
            used.setdefault(of_node[core], set()).add(core)
    for node in homes:
        assert used[node] == cores(topo, {c for c in usable if of_node[c] == node}), (
            f"node {node}: usable cores left out of every share")


def core_speed(topo: Topology, cfg: PlacementConfig) -> dict[int, tuple[bool, int]]:
    """Core -> (has a thread the plan may not use, best perf_rank of its usable threads)."""
    usable = topo.usable() - parse_cpulist(cfg.reserved_cpus)
    of_core = core_of(topo)
    out: dict[int, tuple[bool, int]] = {}
    by_core: dict[int, list] = {}
    for c in topo.cpus:
        if c.online:
            by_core.setdefault(of_core[c.id], []).append(c)
    for core, members in by_core.items():
        mine = [c for c in members if c.id in usable]
        if not mine:
            continue
        ranks = [c.perf_rank for c in mine if c.perf_rank is not None]
        out[core] = (len(mine) < len(members), min(ranks) if ranks else 1 << 30)
    return out


# The L3 rule of placement/plan/auto.py restated: a faster core of another rank in another L3
# group is left alone unless it is at least 10% faster on the first evidence that differs.
L3_RULE_GAIN = 0.10


def expected_gain(topo: Topology, fast: int, slow: int) -> float:
    """Relative single-thread gain of core `fast` over core `slow` on their first differing evidence."""
    by_id = {c.id: c for c in topo.cpus}
    for field in ("highest_perf", "prefcore_ranking", "max_khz", "base_khz"):
        a, b = getattr(by_id[fast], field), getattr(by_id[slow], field)
        if a is not None and b is not None and b > 0 and a != b:
            return a / b - 1.0
    return 0.0


def check_fastest_hot_cores(topo: Topology, plan: Plan, cfg: PlacementConfig) -> None:
    """On every node, no core the plan leaves to background roles is faster than a hot core,
    except another rank's core in another L3 group that the L3 rule keeps apart (gain < 10%)."""
    speed = core_speed(topo, cfg)
    of_node = node_of(topo)
    l3 = {c.id: c.l3 for c in topo.cpus}
    owner: dict[int, int] = {}
    hot: dict[int, set[int]] = {}
    used: dict[int, set[int]] = {}
    for r in plan.ranks:
        for role in HOT_ROLES:
            for core in cores(topo, r.cpus(role)):
                hot.setdefault(of_node[core], set()).add(core)
        for core in cores(topo, r.share()):
            used.setdefault(of_node[core], set()).add(core)
            owner[core] = r.local_rank
    for node, hot_cores in hot.items():
        for bg in used.get(node, set()) - hot_cores:
            for h in hot_cores:
                if speed[bg] >= speed[h]:
                    continue
                kept_apart = (owner[bg] != owner[h] and l3[bg] != l3[h] and speed[bg][0] == speed[h][0]
                              and expected_gain(topo, bg, h) < L3_RULE_GAIN)
                assert kept_apart, (f"node {node}: hot core {h} (speed {speed[h]}) is slower than background "
                                    f"core {bg} (speed {speed[bg]}) and the L3 rule does not keep them apart")
