"""The one configuration tree: dataclasses, validated, loaded from YAML and dotted overrides.

The same keys work as `placerun` overrides (`placement.policy=exclusive`), in a Hydra
app (registered in Hydra's ConfigStore by placement.integrations.hydra), and as
keyword arguments of `placement.attach()`. Unknown keys and bad values fail at start
with one line that lists the valid choices.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from placement.errors import ConfigError

POLICIES = ("auto", "node", "socket", "exclusive", "core-complex", "none")
MEMORY_MODES = ("bind", "preferred", "interleave", "none")
SMT_MODES = ("avoid", "use")
COMM_TIMING = ("auto", "wall", "flight_recorder", "hook", "off")
TUNE_RULES = ("runqueue", "nccl_core", "dataloader_size", "faster_core", "numa_balancing")


@dataclass
class MonitorConfig:
    enabled: bool = True
    log_dir: str = "placement_logs"
    flush_every: int = 10  # steps between JSONL flushes (always flushed at exit)
    rescan_every: int = 20  # steps between rescans of the thread list
    exchange_every: int = 20  # steps between cross-rank exchanges (straggler naming)
    summary_every: int = 50  # steps between one-line logging summaries; 0 = off
    tensorboard: bool = False  # write TensorBoard scalars when tensorboard is installed
    comm_timing: str = "auto"  # auto | wall | flight_recorder | hook | off


@dataclass
class TuneConfig:
    enabled: bool = True
    dry_run: bool = False  # log what it would do, change nothing
    window: int = 20  # steps per evaluation window
    rules: list[str] = field(default_factory=lambda: list(TUNE_RULES))
    runq_wait_pct: float = 10.0  # hot thread runqueue wait, % of step time, that triggers a move
    comm_share_pct: float = 30.0  # comm share of step above which NCCL threads get their own core
    data_share_pct: float = 20.0  # data wait share of step above which the dataloader set grows
    min_gain_pct: float = 2.0  # an action must beat the noise band by this much to be kept
    cooldown_windows: int = 1  # windows to wait after an action before the next
    max_backoff_windows: int = 16  # cap of the exponential back-off after reverts
    background_nice: int = 5  # nice value given to background roles (0 = leave alone)


@dataclass
class PlacementConfig:
    policy: str = "auto"  # auto | node | socket | exclusive | core-complex | none
    memory: str = "bind"  # bind | preferred | interleave | none
    reserved_cpus: str = ""  # kernel cpu-list of housekeeping CPUs never used, e.g. "0,1"
    smt: str = "avoid"  # avoid: hot roles get a whole core, one thread per core used; use: siblings too
    prefer_fast_cores: bool = True  # hot roles on the lowest perf_rank cores
    strict: bool = True  # False: run a degraded plan with warnings instead of failing
    dataloader_workers: int = 2  # DataLoader workers per rank the plan sizes for
    nccl_topo_file: str = ""  # NCCL topology XML; empty = $NCCL_TOPO_FILE if set
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlacementConfig":
        return load_config(base=d)


def _choices(key: str, value: Any, valid: Iterable[str]) -> None:
    if value not in valid:
        raise ConfigError(f"placement.{key}={value!r} is not valid; choose one of: {', '.join(valid)}")


def _range(key: str, value: float, lo: float, hi: float | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"placement.{key}={value!r} is out of range; valid: {rng}")


def validate(cfg: PlacementConfig) -> PlacementConfig:
    """Check every value; raise ConfigError with one line naming the value and the valid choices."""
    from placement.cpuset import parse_cpulist

    _choices("policy", cfg.policy, POLICIES)
    _choices("memory", cfg.memory, MEMORY_MODES)
    _choices("smt", cfg.smt, SMT_MODES)
    try:
        parse_cpulist(cfg.reserved_cpus)
    except ValueError:
        raise ConfigError(f"placement.reserved_cpus={cfg.reserved_cpus!r} is not a cpu list; "
                          "valid: a kernel cpu list such as '0,1' or '0-3,64-67'") from None
    _range("dataloader_workers", cfg.dataloader_workers, 0)
    m = cfg.monitor
    _choices("monitor.comm_timing", m.comm_timing, COMM_TIMING)
    for k in ("flush_every", "rescan_every", "exchange_every"):
        _range(f"monitor.{k}", getattr(m, k), 1)
    _range("monitor.summary_every", m.summary_every, 0)
    t = cfg.tune
    for r in t.rules:
        _choices("tune.rules", r, TUNE_RULES)
    _range("tune.window", t.window, 2, 10000)
    for k in ("runq_wait_pct", "comm_share_pct", "data_share_pct"):
        _range(f"tune.{k}", getattr(t, k), 0.0, 100.0)
    _range("tune.min_gain_pct", t.min_gain_pct, 0.0, 100.0)
    _range("tune.cooldown_windows", t.cooldown_windows, 0, 1000)
    _range("tune.max_backoff_windows", t.max_backoff_windows, 1, 100000)
    _range("tune.background_nice", t.background_nice, 0, 19)
    return cfg


def load_config(overrides: Iterable[str] = (), config_file: str | None = None,
                base: dict[str, Any] | None = None) -> PlacementConfig:
    """Build a validated PlacementConfig from defaults, then a YAML file, then a dict, then
    dotted overrides ("placement.policy=exclusive" or "policy=exclusive").

    The YAML file may hold the keys at top level or under a `placement:` key.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    conf = OmegaConf.structured(PlacementConfig)
    layers = []
    if config_file:
        try:
            loaded = OmegaConf.load(config_file)
        except OSError as e:
            raise ConfigError(f"cannot read placement config file {config_file!r}: {e.strerror or e}") from None
        except Exception as e:  # YAML syntax
            raise ConfigError(f"placement config file {config_file!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is not None and "placement" in loaded and len(loaded) == 1:
            loaded = loaded.placement
        layers.append((config_file, loaded))
    if base:
        layers.append(("arguments", OmegaConf.create(base)))
    dotlist = []
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not KEY=VALUE; e.g. placement.policy=exclusive")
        key, value = o.split("=", 1)
        key = key.strip().lstrip("+")
        if key.startswith("placement."):
            key = key[len("placement."):]
        # `key=` means the empty value (e.g. no reserved CPUs), not YAML's null.
        dotlist.append(f"{key}={value}" if value.strip() else f"{key}=''")
    if dotlist:
        layers.append(("overrides", OmegaConf.from_dotlist(dotlist)))
    for where, layer in layers:
        try:
            conf = OmegaConf.merge(conf, layer)
        except OmegaConfBaseException as e:
            raise ConfigError(_one_line(e, where)) from None
    cfg = OmegaConf.to_object(conf)
    return validate(cfg)


def _one_line(e: Exception, where: str) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0]
    if "not in" in msg:
        valid = ", ".join(_all_keys(PlacementConfig))
        return f"unknown key placement.{key} (from {where}); valid keys: {valid}"
    return f"bad value for placement.{key} (from {where}): {msg}"


def _all_keys(cls: type, prefix: str = "placement.") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        sub = {"monitor": MonitorConfig, "tune": TuneConfig}.get(f.name) if cls is PlacementConfig else None
        if sub is not None:
            out.extend(_all_keys(sub, prefix + f.name + "."))
        else:
            out.append(prefix + f.name)
    return out
