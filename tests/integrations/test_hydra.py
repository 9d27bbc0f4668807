"""Hydra: the `placement` group composed with real Hydra (compose + initialize_config_dir), the
YAML files of configs/placement equal to the ConfigStore, and the same keys giving the same Plan
three ways: a Hydra app's overrides, placerun's overrides (load_config) and attach() keywords."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from placement.attach_api import build_config
from placement.config import PlacementConfig, load_config
from placement.errors import ConfigError
from placement.integrations.hydra import (PRESET_PACKAGES, PRESETS, changed_settings, register_configs,
                                         to_placement_config)
from placement.plan import make_plan
from placement.plan.model import JobSpec
from placement.topology import discover
from sysfs_builder import make_tree

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
APP = REPO / "examples" / "hydra_app"


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_configs()


def _compose(config_dir: Path, overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture(scope="module")
def store_app(tmp_path_factory) -> Path:
    """A primary config that takes `placement` from the ConfigStore only."""
    d = tmp_path_factory.mktemp("store_app")
    (d / "config.yaml").write_text("defaults:\n  - placement: default\n  - _self_\n")
    return d


# ---------------------------------------------------------------- the YAML mirror


def test_default_yaml_holds_every_key_with_its_default():
    d = yaml.safe_load((CONFIGS / "placement" / "default.yaml").read_text())
    d.pop("defaults")
    assert d == PlacementConfig().to_dict()


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in PRESETS.items() for o in opts])
def test_preset_yaml_equals_configstore(group, option):
    path = CONFIGS / "placement" / group / f"{option}.yaml"
    text = path.read_text()
    assert text.startswith(f"# @package {PRESET_PACKAGES[group]}\n"), path
    assert yaml.safe_load(text) == PRESETS[group][option]


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in PRESETS.items() for o in opts])
def test_preset_yaml_works_with_placement_config_too(group, option):
    """A Hydra group file given to placerun --placement-config (or attach(config=path)): its keys
    land under its `# @package`, as Hydra puts them; its second line says what the file is."""
    path = CONFIGS / "placement" / group / f"{option}.yaml"
    assert path.read_text().splitlines()[1].startswith(f"# Hydra config group file: placement/{group}={option}")
    keys: dict = PRESETS[group][option]
    for part in reversed(PRESET_PACKAGES[group].split(".")[1:]):
        keys = {part: keys}
    assert load_config(config_file=str(path)) == load_config(base=keys)


def test_the_hydra_primary_config_says_what_it_is_and_names_the_plain_one():
    path = CONFIGS / "placement" / "default.yaml"
    assert "Hydra primary config" in path.read_text().splitlines()[0]
    assert "configs/placement.example.yaml" in path.read_text().splitlines()[0]
    with pytest.raises(ConfigError, match=r"Hydra primary config .* e\.g\. a copy of configs/placement\.example\.yaml"):
        load_config(config_file=str(path))


def test_preset_files_are_exactly_the_registered_options():
    for group, options in PRESETS.items():
        assert sorted(p.stem for p in (CONFIGS / "placement" / group).glob("*.yaml")) == sorted(options)


YAML_VS_STORE = [[], ["placement/policy=bandwidth"], ["placement/monitor=verbose"],
                 ["placement/tune=conservative", "placement/policy=container"],
                 ["placement/monitor=off", "placement.policy=node", "placement.tune.window=30"]]

# Composes from copies of the YAML files: a process of its own, since Hydra refuses a file and a
# ConfigStore entry of the same name and this test process registered the presets.
_COMPOSE_FROM_FILES = """
import json, shutil, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from placement.integrations.hydra import register_configs
configs, app, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
shutil.copytree(configs + "/placement", app + "/placement")
open(app + "/config.yaml", "w").write("defaults:\\n  - placement: default\\n  - _self_\\n")
register_configs(presets=False)
out = []
with initialize_config_dir(config_dir=app, version_base="1.3"):
    for overrides in cases:
        out.append(OmegaConf.to_container(compose("config", overrides=overrides), enum_to_str=True))
print(json.dumps(out))
"""


def test_yaml_files_compose_like_the_configstore(store_app, tmp_path):
    proc = subprocess.run([sys.executable, "-c", _COMPOSE_FROM_FILES, str(CONFIGS), str(tmp_path / "app"),
                           json.dumps(YAML_VS_STORE)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from_files = json.loads(proc.stdout)
    from_store = [OmegaConf.to_container(_compose(store_app, o), enum_to_str=True) for o in YAML_VS_STORE]
    assert from_files == from_store
    assert from_files[1]["placement"]["memory"] == "interleave"  # the presets were applied


# ---------------------------------------------------------------- the example app


def test_example_app_composes_with_overrides():
    cfg = _compose(APP / "conf", ["placement.policy=exclusive", "placement/tune=off", "train.steps=7"])
    pc = to_placement_config(cfg.placement)
    assert (pc.policy, pc.tune.enabled, cfg.train.steps) == ("exclusive", False, 7)
    assert pc == load_config(["placement.policy=exclusive", "placement.tune.enabled=false"])


def test_changed_settings_are_what_the_app_set(store_app):
    assert changed_settings(_compose(store_app, []).placement) == {}
    got = changed_settings(_compose(store_app, ["placement/monitor=light", "placement.policy=node"]).placement)
    assert got == {"policy": "node", "monitor": {"flush_every": 50, "handover_min_s": 2.0, "rescan_every": 100,
                                                 "exchange_every": 100, "summary_every": 0}}
    assert build_config(None, got) == load_config([
        "placement.policy=node", "placement.monitor.flush_every=50", "placement.monitor.handover_min_s=2.0",
        "placement.monitor.rescan_every=100",
        "placement.monitor.exchange_every=100", "placement.monitor.summary_every=0"])


def test_to_placement_config_takes_every_form(store_app):
    node = _compose(store_app, ["placement/policy=bandwidth", "placement.tune.rules=[runqueue]"]).placement
    want = load_config(["placement.policy=core-complex", "placement.memory=interleave",
                        "placement.tune.rules=[runqueue]"])
    assert to_placement_config(node) == want  # DictConfig
    assert to_placement_config(OmegaConf.to_object(node)) == want  # the schema's dataclass, Enum values
    assert to_placement_config(want) == want and to_placement_config(want.to_dict()) == want


def test_composed_config_pickles():
    """Hydra's multirun launchers (submitit, joblib) pickle the composed config."""
    cfg = _compose(APP / "conf", ["placement/policy=bandwidth"])
    again = pickle.loads(pickle.dumps(cfg))
    assert to_placement_config(again.placement) == to_placement_config(cfg.placement)


def test_register_configs_is_idempotent(store_app):
    register_configs()
    assert to_placement_config(_compose(store_app, []).placement) == PlacementConfig()


# ---------------------------------------------------------------- same Plan three ways

# (Hydra overrides, placerun overrides, attach() keyword arguments): the same settings. attach()
# takes nested dicts and dotted keys alike: attach(tune={"enabled": False}), attach(**{"tune.enabled": False}).
THREE_WAYS = [
    (["placement.policy=exclusive"], ["placement.policy=exclusive"], {"policy": "exclusive"}),
    (["placement/policy=bandwidth"], ["placement.policy=core-complex", "placement.memory=interleave"],
     {"policy": "core-complex", "memory": "interleave"}),
    # Hydra reads an unquoted comma as a sweep: a cpu list with commas is quoted there.
    (["placement.smt=use", "placement.reserved_cpus='0,112'", "placement.prefer_fast_cores=false"],
     ["placement.smt=use", "placement.reserved_cpus=0,112", "placement.prefer_fast_cores=false"],
     {"smt": "use", "reserved_cpus": "0,112", "prefer_fast_cores": False}),
    (["placement/policy=container", "placement.dataloader_workers=6"],
     ["placement.memory=preferred", "placement.strict=false", "placement.dataloader_workers=6"],
     {"memory": "preferred", "strict": False, "placement.dataloader_workers": 6}),
    (["placement/policy=off", "placement/tune=off"],
     ["placement.policy=none", "placement.memory=none", "placement.tune.enabled=false"],
     {"policy": "none", "memory": "none", "tune": {"enabled": False}}),
]


@pytest.fixture(scope="module")
def dgx(tmp_path_factory):
    return discover(make_tree(tmp_path_factory.mktemp("trees"), "dgx_h100"))


@pytest.mark.parametrize("hydra_ov, placerun_ov, attach_kw", THREE_WAYS,
                         ids=["exclusive", "bandwidth-preset", "smt-reserved", "container-preset", "off-presets"])
def test_same_plan_three_ways(dgx, hydra_ov, placerun_ov, attach_kw):
    job = JobSpec(nproc_per_node=8, gpus=list(range(8)), visible_gpus=list(range(8)))
    via_hydra = to_placement_config(_compose(APP / "conf", hydra_ov).placement)
    via_placerun = load_config(placerun_ov)
    via_attach = build_config(None, attach_kw)  # what attach(**attach_kw) builds
    assert via_hydra == via_placerun == via_attach
    assert via_hydra != PlacementConfig(), "each case changes something"
    plans = [make_plan(dgx, job, c).to_dict() for c in (via_hydra, via_placerun, via_attach)]
    assert plans[0] == plans[1] == plans[2]


def test_the_settings_change_the_plan(dgx):
    """The three-way cases compare plans that differ from the default one (the test can fail)."""
    job = JobSpec(nproc_per_node=8, gpus=list(range(8)), visible_gpus=list(range(8)))
    default = make_plan(dgx, job, PlacementConfig()).to_dict()
    changed = [make_plan(dgx, job, load_config(p)).to_dict() != default for _, p, _ in THREE_WAYS]
    assert sum(changed) >= 3, changed


# ---------------------------------------------------------------- bad input


def _cause(e: BaseException) -> str:
    return f"{e}\n{e.__cause__}"


@pytest.mark.parametrize("override, needles", [
    ("placement.bogus=1", ["Could not override 'placement.bogus'", "valid keys: policy, memory, reserved_cpus"]),
    ("placement.tune.bogus=1", ["placement.tune.bogus", "valid keys: enabled, dry_run, window"]),
    ("placement.policy=bogus", ["placement.policy=bogus",
                                "expected one of [auto, node, socket, exclusive, core-complex, none]"]),
    ("placement.memory=local", ["expected one of [bind, preferred, interleave, none]"]),
    ("placement.tune.rules=[runqueue,nope]", ["expected one of [runqueue, nccl_core, dataloader_size"]),
    ("placement.monitor.flush_every=often", ["placement.monitor.flush_every", "could not be converted to Integer"]),
])
def test_bad_overrides_fail_in_hydra_with_the_choices(store_app, override, needles):
    with pytest.raises(ConfigCompositionException) as e:
        _compose(store_app, [override])
    for needle in needles:
        assert needle in _cause(e.value)


def test_unknown_preset_lists_the_options(store_app):
    with pytest.raises(MissingConfigException) as e:
        _compose(store_app, ["placement/tune=fast"])
    msg = str(e.value)
    assert "Could not find 'placement/tune/fast'" in msg
    assert all(o in msg for o in PRESETS["tune"])


@pytest.mark.parametrize("override, needle", [
    ("placement.tune.window=1", "placement.tune.window=1 is out of range; valid: [2, 10000]"),
    ("placement.reserved_cpus=x-y", "not a cpu list"),
])
def test_values_hydra_cannot_check_fail_in_validate(store_app, override, needle):
    node = _compose(store_app, [override]).placement
    with pytest.raises(ConfigError) as e:
        to_placement_config(node)
    assert needle in str(e.value) and "\n" not in str(e.value)


def _run_app(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(APP / "train.py"), f"hydra.run.dir={tmp_path / 'hydra'}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_app_bad_input_is_hydras_error_without_traceback(tmp_path):
    proc = _run_app(["placement.bogus=1"], tmp_path)
    assert proc.returncode == 1
    assert "Key 'bogus' not in 'PlacementConfig (valid keys: policy, memory," in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run_app(["placement.tune.window=1"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "train.py: placement.tune.window=1 is out of range; valid: [2, 10000]"


@pytest.mark.slow
def test_app_trains_and_records(tmp_path):
    """The real app, alone: it binds itself (attach without placerun) and records every step."""
    logs = tmp_path / "logs"
    proc = _run_app(["placement/monitor=verbose", "placement/tune=off", f"placement.monitor.log_dir={logs}",
                     "train.steps=6", "train.workers=1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hydra_app: 6 steps" in proc.stdout
    lines = (logs / "rank0.jsonl").read_text().splitlines()
    assert sum('"type":"step"' in line for line in lines) == 6


@pytest.mark.slow
def test_app_under_placerun_keeps_placeruns_settings(tmp_path):
    """placerun's overrides hold for the keys the app leaves at default; the app's preset applies."""
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([str(Path(sys.executable).parent / "placerun"), "--standalone", "--nproc-per-node", "2",
                           "placement.tune.enabled=false", f"placement.monitor.log_dir={logs}", str(APP / "train.py"),
                           "placement/monitor=verbose", "train.steps=5", "train.workers=0",
                           f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hydra_app: 5 steps" in proc.stdout and f"tune off, records in {logs}" in proc.stdout
    for rank in (0, 1):
        records = [json.loads(line) for line in (logs / f"rank{rank}.jsonl").read_text().splitlines()]
        start = next(r for r in records if r["type"] == "start" and r.get("source") == "monitor")
        assert start["every"]["summary"] == 10  # placement/monitor=verbose from the app
        assert sum(r["type"] == "step" for r in records) == 5
