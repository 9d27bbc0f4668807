"""The tune rules by name (config `tune.rules`), in the order the tuner asks them."""
from __future__ import annotations

from placement.tune.rules.base import Proposal, Rule, RuleContext
from placement.tune.rules.dataloader_size import DataloaderSizeRule
from placement.tune.rules.faster_core import FasterCoreRule
from placement.tune.rules.nccl_core import NcclCoreRule
from placement.tune.rules.numa_balancing import NumaBalancingRule
from placement.tune.rules.runqueue import RunqueueRule

RULES: dict[str, type[Rule]] = {cls.name: cls for cls in (
    RunqueueRule, NcclCoreRule, DataloaderSizeRule, FasterCoreRule, NumaBalancingRule)}


def make_rules(names: list[str]) -> list[Rule]:
    """Fresh rule objects for the enabled names, in priority order (config order ignored)."""
    wanted = set(names)
    return [cls() for name, cls in RULES.items() if name in wanted]


__all__ = ["RULES", "Proposal", "Rule", "RuleContext", "make_rules"]
