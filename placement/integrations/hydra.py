"""PlacementConfig in Hydra's ConfigStore, so a Hydra app composes it like its own configs.

    from placement.integrations.hydra import changed_settings, register_configs
    register_configs()                    # before @hydra.main runs
    # conf/config.yaml:  defaults: [placement: default, _self_]
    # python train.py placement.policy=exclusive placement/tune=off
    handle = placement.attach(model, optimizer, config=changed_settings(cfg.placement))

Group `placement` holds `schema` (the typed tree), `default` (schema + presets) and three preset
groups, `placement/policy`, `placement/monitor`, `placement/tune`: '/' selects a preset, '.' sets
one key, as everywhere in Hydra (`hydra/launcher=...`). configs/placement/ holds the same configs
as YAML files, to read or copy into an app's config dir (then register_configs(presets=False));
tests keep the two equal.

The schema is PlacementConfig with its choice fields typed as Enums and its classes named after
their valid keys: Hydra then reports `placement.policy=bogus` and `placement.bogus=1` with its own
error, and that error lists the valid choices (OmegaConf names the node's type and the Enum's
members in its message; nothing else of it can be shaped).
"""
from __future__ import annotations

import dataclasses
import enum
import sys
import typing
from typing import Any

from placement.config import (CHOICES, MetricsConfig, MonitorConfig, PlacementConfig, TuneConfig, choice_values,
                              load_config)

GROUP = "placement"

# Presets: group -> option -> the keys it sets. Options of `policy` set top-level keys
# (package `placement`); `monitor` and `tune` options fill the subtree of their name.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "policy": {
        "default": {"policy": "auto"},
        # Each rank gets whole cores of its GPU's node, hot threads alone on the fastest ones.
        "exclusive": {"policy": "exclusive", "smt": "avoid", "memory": "bind"},
        # Containers that refuse membind (Kubernetes, some Slurm setups): prefer the local node
        # instead of failing, and run a degraded plan with warnings if the cpuset is too small.
        "container": {"memory": "preferred", "strict": False},
        # Bandwidth-bound work: ranks spread over L3/cluster groups, memory interleaved.
        "bandwidth": {"policy": "core-complex", "memory": "interleave"},
        # Launch and monitor only: no binding, no memory policy.
        "off": {"policy": "none", "memory": "none"},
    },
    "monitor": {
        "default": {"enabled": True},
        "off": {"enabled": False},
        # Every figure as often as it is cheap enough to debug a run.
        "verbose": {"enabled": True, "flush_every": 1, "handover_min_s": 0.0, "rescan_every": 5, "exchange_every": 5,
                    "exchange_min_s": 0.0,
                    "summary_every": 10},
        # Long production runs: fewer exchanges and rescans, no console summary.
        "light": {"enabled": True, "flush_every": 50, "handover_min_s": 2.0, "rescan_every": 100, "exchange_every": 100,
                  "summary_every": 0},
    },
    "tune": {
        "default": {"enabled": True},
        "off": {"enabled": False},
        "dry_run": {"enabled": True, "dry_run": True},
        # Longer windows and a higher bar: only clear wins are kept.
        "conservative": {"enabled": True, "window": 50, "min_gain_pct": 5.0, "cooldown_windows": 3},
    },
}
PRESET_PACKAGES = {"policy": GROUP, "monitor": f"{GROUP}.monitor", "tune": f"{GROUP}.tune"}

# Fields whose valid values are a closed set (config.CHOICES: Policy, MemoryMode, ...): typed as
# Enums in the schema.
_PREFIX = {"PlacementConfig": "", "MonitorConfig": "monitor.", "TuneConfig": "tune.", "MetricsConfig": "metrics."}
_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    (cls, key[len(prefix):]): choice_values(key)
    for key in CHOICES for cls, prefix in _PREFIX.items()
    if key.startswith(prefix) and "." not in key[len(prefix):]}


def _choice_enum(qualname: str, values: tuple[str, ...]) -> type[enum.Enum]:
    # The config's own Enums are named by upper-case names (Policy.CORE_COMPLEX); the schema's
    # members are named by their values ("core-complex" included): OmegaConf converts a string by
    # member name and lists the names when it rejects one.
    e = enum.Enum(qualname, [(v, v) for v in values], type=str, module=__name__, qualname=qualname)
    setattr(sys.modules[__name__], qualname, e)  # importable by name, so pickling works
    return e


def _schema(cls: type, nested: dict[str, type]) -> type:
    """`cls` rebuilt with Enum-typed choice fields and nested schemas, named after its keys."""
    hints = typing.get_type_hints(cls)  # config.py's annotations are strings (PEP 563)
    fields = []
    for f in dataclasses.fields(cls):
        values = _CHOICES.get((cls.__name__, f.name))
        if f.name in nested:
            sub = nested[f.name]
            fields.append((f.name, sub, dataclasses.field(default_factory=sub)))
        elif values is not None and f.default_factory is not dataclasses.MISSING:  # list of choices
            e = _choice_enum(f"{cls.__name__}_{f.name}", values)
            default = [e[v] for v in f.default_factory()]
            fields.append((f.name, list[e], dataclasses.field(default_factory=lambda d=default: list(d))))
        elif values is not None:
            e = _choice_enum(f"{cls.__name__}_{f.name}", values)
            fields.append((f.name, e, dataclasses.field(default=e[str(f.default)])))
        else:
            fields.append((f.name, hints[f.name],
                           dataclasses.field(default=f.default, default_factory=f.default_factory)))
    qualname = f"{cls.__name__}Schema"
    schema = dataclasses.make_dataclass(qualname, fields, namespace={"__module__": __name__})
    setattr(sys.modules[__name__], qualname, schema)
    # OmegaConf's unknown-key error reads "Key 'x' not in '<type __name__>'": the name lists the keys.
    schema.__name__ = f"{cls.__name__} (valid keys: {', '.join(f.name for f in dataclasses.fields(cls))})"
    return schema


MonitorConfigSchema = _schema(MonitorConfig, {})
TuneConfigSchema = _schema(TuneConfig, {})
MetricsConfigSchema = _schema(MetricsConfig, {})
PlacementConfigSchema = _schema(PlacementConfig, {"monitor": MonitorConfigSchema, "tune": TuneConfigSchema,
                                                  "metrics": MetricsConfigSchema})


def register_configs(presets: bool = True) -> None:
    """Store group `placement` in Hydra's ConfigStore: `schema`, and with presets=True also
    `default` and the preset groups. Idempotent; call it before `@hydra.main` (or `compose`) runs.

    An app that composes from its own copies of the configs/placement YAML files (on its search
    path) passes presets=False: Hydra refuses a file and a ConfigStore entry of the same name.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(group=GROUP, name="schema", node=PlacementConfigSchema, package=GROUP)
    if not presets:
        return
    cs.store(group=GROUP, name="default", package=GROUP, node={
        "defaults": ["schema", "_self_"] + [{group: "default"} for group in PRESETS]})
    for group, options in PRESETS.items():
        for name, keys in options.items():
            cs.store(group=f"{GROUP}/{group}", name=name, node=keys, package=PRESET_PACKAGES[group])


def to_placement_config(node: Any) -> PlacementConfig:
    """The composed `cfg.placement` (DictConfig, dict or PlacementConfig) as a validated
    PlacementConfig: the one object attach() and the planner take. Raises ConfigError with the
    valid choices for a value Hydra cannot check (ranges, cpu lists)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    elif dataclasses.is_dataclass(node):  # a PlacementConfig, or OmegaConf.to_object of the schema
        node = dataclasses.asdict(node)
    return load_config(base=_plain(node))


def changed_settings(node: Any) -> dict[str, Any]:
    """The keys of the composed `cfg.placement` whose values differ from PlacementConfig's
    defaults, nested, after validation: what an app hands `placement.attach(config=...)`.

    Under placerun attach() layers its config over the one placerun started with, so keys the
    app leaves at their default keep placerun's values (e.g. `placerun placement.monitor.log_dir=X`)
    and the keys it sets win (binding keys excepted: placerun applied those before the app ran).
    """
    return _diff(to_placement_config(node).to_dict(), PlacementConfig().to_dict())


def _diff(value: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in value.items():
        if isinstance(v, dict):
            sub = _diff(v, default[k])
            if sub:
                out[k] = sub
        elif v != default[k]:
            out[k] = v
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
