"""One config tree: defaults, YAML file, dict and dotted overrides; bad input is one line."""
from pathlib import Path

import pytest
import yaml

from placement.config import (CommTimingMode, MemoryMode, PlacementConfig, Policy, SmtMode, example_yaml, load_config,
                              validate)
from placement.errors import ConfigError


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == PlacementConfig()


EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "placement.example.yaml"


def test_the_example_config_holds_every_key_with_its_default_and_a_comment(capsys):
    """configs/placement.example.yaml, the file to copy: every key with its default (so it stays in
    step with PlacementConfig), a comment on every line, and taken by placerun --placement-config."""
    from placement import launcher

    text = EXAMPLE.read_text()
    assert yaml.safe_load(text) == PlacementConfig().to_dict()
    assert load_config(config_file=str(EXAMPLE)) == PlacementConfig()
    uncommented = [line for line in text.splitlines() if line.strip() and " # " not in line and not line.startswith("#")]
    assert not uncommented
    assert launcher.main(["--nproc-per-node", "1", "--placement-config", str(EXAMPLE), "--dry-run", "t.py"]) == 0
    assert "plan: policy auto" in capsys.readouterr().out


def test_the_example_config_is_the_one_generated_from_the_dataclasses():
    """Its keys, defaults, comments and choices come from config.py (one place): regenerate it with
    `python -m placement.config --example > configs/placement.example.yaml`."""
    assert EXAMPLE.read_text() == example_yaml()


def test_a_choice_key_holds_its_enum_member_and_writes_its_text():
    cfg = load_config(["placement.policy=core-complex", "monitor.comm_timing=hook"], base={"memory": "interleave"})
    assert (cfg.policy, cfg.memory, cfg.monitor.comm_timing) == (Policy.CORE_COMPLEX, MemoryMode.INTERLEAVE,
                                                                 CommTimingMode.HOOK)
    d = cfg.to_dict()
    assert (type(d["policy"]), d["policy"], d["monitor"]["comm_timing"]) == (str, "core-complex", "hook")
    assert yaml.safe_load(yaml.safe_dump(d)) == d  # plain values: safe_dump refuses an Enum
    assert validate(PlacementConfig(smt="use")).smt is SmtMode.USE  # a config built in code is made members


def test_layers_apply_in_order(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("placement:\n  policy: node\n  memory: preferred\n  tune:\n    window: 30\n")
    cfg = load_config(["placement.policy=exclusive", "tune.enabled=false"], config_file=str(f),
                      base={"smt": "use"})
    assert (cfg.policy, cfg.memory, cfg.smt, cfg.tune.window, cfg.tune.enabled) == (
        "exclusive", "preferred", "use", 30, False)


@pytest.mark.parametrize("override, needle", [
    ("placement.bogus=1", "unknown key placement.bogus"),
    ("placement.policy=fast", "choose one of: auto, node, socket, exclusive, core-complex, none"),
    ("placement.memory=local", "choose one of: bind, preferred, interleave, none"),
    ("placement.monitor.flush_every=0", "placement.monitor.flush_every=0 is out of range"),
    ("placement.tune.runq_wait_pct=150", "valid: [0.0, 100.0]"),
    ("placement.reserved_cpus=x-y", "not a cpu list"),
    ("placement.tune.window=abc", "placement.tune.window"),
    ("policy", "is not KEY=VALUE"),
])
def test_bad_overrides_name_value_and_choices(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read placement config file"):
        load_config(config_file=str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config_file=str(bad))


def test_empty_override_value_is_empty_string():
    assert load_config(["placement.reserved_cpus=0,1", "placement.reserved_cpus="]).reserved_cpus == ""


def test_the_environments_settings_lie_beneath_placerun_plan_and_attach(monkeypatch, tmp_path):
    from placement.attach_api import build_config
    from placement.launcher import _plan, parse_placerun_args

    yaml = tmp_path / "p.yaml"
    yaml.write_text("placement:\n  dataloader_workers: 3\n  monitor:\n    flush_every: 7\n")
    monkeypatch.setenv("PLACEMENT_CONFIG", str(yaml))
    monkeypatch.setenv("PLACEMENT_OVERRIDES", "placement.policy=none placement.monitor.flush_every=9")
    monkeypatch.chdir(tmp_path)
    _, cfg, _ = _plan(parse_placerun_args(["--standalone", "--nproc-per-node", "1", "train.py"]))
    assert (cfg.policy, cfg.dataloader_workers, cfg.monitor.flush_every) == ("none", 3, 9)  # words over the file
    _, cfg, _ = _plan(parse_placerun_args(["--standalone", "--nproc-per-node", "1", "placement.policy=node",
                                           "train.py"]))
    assert cfg.policy == "node"  # the command line's words after the environment's
    cfg = build_config(None, {"monitor": {"flush_every": 4}})
    assert (cfg.policy, cfg.dataloader_workers, cfg.monitor.flush_every) == ("none", 3, 4)  # attach()'s over both


def test_a_renamed_key_still_sets_its_new_name_for_a_release_and_says_so_once(tmp_path, capsys):
    """monitor.stall_* became monitor.hang_* (a hung rank is a hang; a step's CPU stall is another
    idea): the old names, from overrides, a YAML file, attach()'s dict or placerun's words, set
    the new key with one deprecation line per old name and process."""
    from placement import config, launcher

    config._said_renamed.clear()
    cfg = load_config(["placement.monitor.stall_min_s=3", "monitor.stall_factor=4"])
    assert (cfg.monitor.hang_min_s, cfg.monitor.hang_factor) == (3.0, 4.0)
    yml = tmp_path / "p.yaml"
    yml.write_text("monitor:\n  stall_min_s: 5\n  stall_pause_s: 30\n")
    cfg = load_config(config_file=str(yml), base={"monitor": {"stall_factor": 6}})
    assert (cfg.monitor.hang_min_s, cfg.monitor.hang_pause_s, cfg.monitor.hang_factor) == (5.0, 30.0, 6.0)
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "is now placement.monitor.hang_" in line]
    assert sorted(said) == sorted({line for line in said}) and len(said) == 3, err
    assert "placement.monitor.stall_min_s is now placement.monitor.hang_min_s" in said[0]
    assert launcher.main(["--nproc-per-node", "1", "--dry-run", "t.py", "placement.monitor.stall_min_s=2"]) == 0
    # a bad value under the old name names the new key and its range, one line
    with pytest.raises(ConfigError, match=r"placement\.monitor\.hang_min_s"):
        load_config(["placement.monitor.stall_min_s=0"])
    assert "placement.monitor.stall_min_s" not in config.keys_table()  # the new names are the documented ones
