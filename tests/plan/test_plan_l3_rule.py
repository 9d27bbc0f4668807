"""The L3 rule of policy auto (placement/plan/auto.py): where every core has its own perf rank
(amd-pstate prefcore), a rank does not trade its hot cores for another rank's cores in another
L3 group for a few percent; it does for a core that is really faster (>= 10%). Fixture trees
from tests/sysfs_builder.py, read by discover(), planned by make_plan."""
from placement.config import load_config
from placement.plan import JobSpec, make_plan
from placement.roles import HOT_ROLES, ThreadRole
from placement.topology import discover

from plan_checks import check_auto
from sysfs_builder import make_machine_tree, make_tree, prefcore_two_ccd


def plan_two_ranks(root):
    topo = discover(root)
    cfg = load_config([])
    plan = make_plan(topo, JobSpec(2, dataloader_workers=cfg.dataloader_workers), cfg)
    check_auto(topo, plan, cfg)
    l3 = {c.id: c.l3 for c in topo.cpus}
    return topo, plan, l3


def test_prefcore_steps_of_a_few_percent_keep_each_rank_in_its_l3_group(tmp_path):
    topo, plan, l3 = plan_two_ranks(make_tree(tmp_path, "prefcore_two_ccd"))
    assert len({c.perf_rank for c in topo.cpus}) == 16  # every core its own rank
    for r in plan.ranks:
        hot = set().union(*(r.cpus(role) for role in HOT_ROLES))
        assert len({l3[c] for c in r.share()}) == 1, f"rank {r.local_rank} share spans L3 groups"
        # its hot cores are the fastest of its own L3 group
        own = sorted(r.share(), key=lambda c: topo.cpu(c).perf_rank)
        assert hot == set(own[:2])
    # the faster CCD's non-hot cores stay with rank 1 although they beat rank 0's hot cores
    rank0_hot = plan.ranks[0].cpus(ThreadRole.MAIN) | plan.ranks[0].cpus(ThreadRole.NCCL)
    rank1_bg = plan.ranks[1].cpus(ThreadRole.OTHER)
    assert max(topo.cpu(c).perf_rank for c in rank0_hot) > min(topo.cpu(c).perf_rank for c in rank1_bg)


def test_a_core_at_least_ten_percent_faster_is_worth_leaving_the_l3_group(tmp_path):
    boosted = frozenset({12, 13, 14, 15})  # ranking 250 against 202-203: +23%
    root = make_machine_tree(tmp_path, prefcore_two_ccd(boosted))
    topo, plan, l3 = plan_two_ranks(root)
    hot = set().union(*(r.cpus(role) for r in plan.ranks for role in HOT_ROLES))
    assert hot == boosted  # both ranks' hot cores are the boosted ones
    r0 = plan.ranks[0]
    assert r0.cpus(ThreadRole.MAIN) | r0.cpus(ThreadRole.NCCL) <= boosted
    assert len({l3[c] for c in r0.share()}) == 2  # the price, paid for a real gain
    assert not r0.share() & plan.ranks[1].share()
