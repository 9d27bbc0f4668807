"""Bad tune settings fail at start with one line naming the value and the valid choices."""
from __future__ import annotations

import pytest

from placement.config import load_config
from placement.errors import ConfigError
from placement.tune.rules import make_rules


@pytest.mark.parametrize("override, expect", [
    ("tune.rules=[runqueue,fastest_core]", "choose one of: runqueue, nccl_core, dataloader_size, faster_core, numa_balancing"),
    ("tune.runq_wait_pct=150", "placement.tune.runq_wait_pct=150.0 is out of range; valid: [0.0, 100.0]"),
    ("tune.comm_share_pct=-1", "placement.tune.comm_share_pct=-1.0 is out of range; valid: [0.0, 100.0]"),
    ("tune.data_share_pct=101", "valid: [0.0, 100.0]"),
    ("tune.window=1", "placement.tune.window=1 is out of range; valid: [2, 10000]"),
    ("tune.max_backoff_windows=0", "valid: [1, 100000]"),
    ("tune.background_nice=20", "valid: [0, 19]"),
    ("tune.cooldown=3", "unknown key placement.tune.cooldown"),
])
def test_bad_tune_settings_fail_at_start(override, expect):
    with pytest.raises(ConfigError) as e:
        load_config([f"placement.{override}"])
    msg = str(e.value)
    assert expect in msg and "\n" not in msg


def test_rule_subset_keeps_priority_order():
    cfg = load_config(["placement.tune.rules=[numa_balancing,runqueue]", "placement.tune.dry_run=true"])
    assert [r.name for r in make_rules(cfg.tune.rules)] == ["runqueue", "numa_balancing"]
    assert cfg.tune.dry_run is True
