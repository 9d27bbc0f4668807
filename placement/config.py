"""The one configuration tree: dataclasses, validated, loaded from YAML and dotted overrides.

The same keys work as `placerun` overrides (`placement.policy=exclusive`), in a Hydra
app (registered in Hydra's ConfigStore by placement.integrations.hydra), and as
keyword arguments of `placement.attach()`. Unknown keys and bad values fail at start
with one line that lists the valid choices.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import reprlib
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from placement._procfs import read_bounded
from placement.cpuset import MAX_CPUS, parse_cpulist
from placement.errors import ConfigError
from placement.vocab import Vocabulary


class Policy(Vocabulary):
    """placement.policy: per thread role (`auto`), one CPU set per process (torchrun's
    --numa-binding modes), or no binding (`none`)."""

    AUTO = "auto"
    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"
    NONE = "none"


# The process-level policies: torchrun's --numa-binding modes (plan/process_level.py).
PROCESS_LEVEL_POLICIES = (Policy.NODE, Policy.SOCKET, Policy.EXCLUSIVE, Policy.CORE_COMPLEX)


class MemoryMode(Vocabulary):
    """placement.memory: the memory policy a plan asks for (the kernel's read-back may name more
    modes, placement._procfs.MEMPOLICY_NAMES)."""

    BIND = "bind"
    PREFERRED = "preferred"
    INTERLEAVE = "interleave"
    NONE = "none"


class SmtMode(Vocabulary):
    """placement.smt."""

    AVOID = "avoid"
    USE = "use"


class CommTimingMode(Vocabulary):
    """placement.monitor.comm_timing: how collectives are timed (monitor/comm/timing.py)."""

    AUTO = "auto"
    WALL = "wall"
    FLIGHT_RECORDER = "flight_recorder"
    HOOK = "hook"
    OFF = "off"


class NcclTimingMode(Vocabulary):
    """placement.monitor.nccl_timing (bind/nccl_env.py)."""

    AUTO = "auto"  # on, unless CUDA_DEVICE_MAX_CONNECTIONS=1 (timing would break comm/compute overlap)
    ON = "on"
    OFF = "off"


TUNE_RULES = ("runqueue", "nccl_core", "dataloader_size", "faster_core", "numa_balancing")
MAX_DATALOADER_WORKERS = 1024  # per rank; more than any node has cores for
CONFIG_FILE_MAX = 1024 * 1024  # a placement YAML is a few hundred bytes
SHOWN_MAX = 200  # characters of a bad value quoted in a config error
# Keys renamed (old -> new, without "placement."): the old name still sets the new key for a
# release, with one deprecation line a process. "stall" is a step's CPU-stall part; a rank that
# completes no step is hung (docs/design.md, words).
RENAMED_KEYS = {"monitor.stall_factor": "monitor.hang_factor", "monitor.stall_min_s": "monitor.hang_min_s",
                "monitor.stall_pause_s": "monitor.hang_pause_s"}
_said_renamed: set[str] = set()


def _shown(value: Any) -> str:
    """A bad value as an error quotes it: its repr cut to SHOWN_MAX characters, built without
    walking all of it (a YAML alias bomb of a few hundred bytes loads as millions of shared
    items, and its full repr is megabytes)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 4, SHOWN_MAX, SHOWN_MAX
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = 8
    text = r.repr(value)
    return text if len(text) <= SHOWN_MAX else text[:SHOWN_MAX - 3] + "..."


# monitor.budget_pct's default, written once: the comm timers and selftest take it from here.
BUDGET_PCT = 0.3


def _key(default: Any, doc: str) -> Any:
    """A configuration key with its default and its one-line description: keys_table() makes
    README's table of keys from these."""
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class MonitorConfig:
    enabled: bool = _key(True, "the step monitor: per-step records, straggler naming, stall watch")
    auto: bool = _key(True, "under placerun, monitor every Python worker without a line of its code: steps found at "
                            "its optimizer steps and DataLoader fetches (docs/monitor.md); false = only "
                            "placement.attach() or a framework callback starts it (binding stays)")
    log_dir: str = _key("placement_logs", "where each rank writes `rank<R>.jsonl` (a directory of yours no other user "
                                          "can write; a second job there writes `rank<R>-<n>.jsonl`)")
    log_rotate_mb: float = _key(256.0, "a rank's log past this size becomes `rank<R>.<N>.jsonl.gz` (compressed aside, "
                                       "~10x smaller; `placement report` reads both); 0 = never")
    flush_every: int = _key(20, "steps between JSONL flushes (always flushed at exit)")
    handover_min_s: float = _key(0.5, "least time between two hand-overs of steps to the monitor thread: at short "
                                      "steps each builds, writes and exchanges flush_every x 2^k steps at once, the "
                                      "tuner's windows among them, but a window that ran 10% slower is handed over "
                                      "as it ends (docs/monitor.md); 0 = at every due step")
    handover_max_s: float = _key(4.0, "the most the budget stretches that floor to (and tune.window_min_s by as much), "
                                      "a doubling at a time, while placement costs more than budget_pct with the "
                                      "counters read as seldom as allowed (docs/monitor.md); <= handover_min_s: never")
    rescan_every: int = _key(20, "steps between rescans of the thread list and span readings of every thread; "
                                  "while no tuner judges windows, at least 4 x handover_min_s apart")
    exchange_every: int = _key(20, "steps per cross-rank exchange window (straggler naming)")
    record_min_s: float = _key(0.1, "least time a step record covers: at shorter steps a record holds several "
                                      "steps (a divisor of exchange_every), its figures per-step means, each "
                                      "step's time kept, x the factor the budget stretches handover_min_s by "
                                      "(docs/monitor.md); 0 = a record a step")
    exchange_min_s: float = _key(1.0, "least time between two exchanges (x half the paced floor's scale while the budget "
                                      "stretches it): at shorter windows rank 0 agrees with the ranks to exchange at "
                                      "every 2^k-th window only, each exchange carrying the windows since the last "
                                      "(docs/monitor.md); 0 = an exchange a window")
    straggler_min_cost_pct: float = _key(3.0, "a straggler is named only when what it costs the job (its lateness "
                                              "removed) is at least this share of step time (docs/monitor.md)")
    straggler_confirm_windows: int = _key(2, "exchange windows in a row a straggler must cost that much before it is "
                                             "named (then named for as long as it does)")
    straggler_steady_pct: float = _key(90.0, "... if it was late at this share of their steps; late at fewer (ranks "
                                             "taking turns on a busy host), it is named after straggler_persist_windows")
    straggler_persist_windows: int = _key(20, "windows in a row a straggler late at fewer steps than that must cost "
                                              "before it is named (docs/monitor.md)")
    summary_every: int = _key(50, "steps between one-line logging summaries; 0 = off")
    digest_every: int = _key(1000, "steps per `digest` record in the log: their sums and step-time histogram, what "
                                   "`placement report` reads of a long job (docs/monitor.md); 0 = off")
    tensorboard: bool = _key(False, "write TensorBoard scalars when tensorboard is installed")
    comm_timing: CommTimingMode = _key(CommTimingMode.AUTO, "how collectives are timed (docs/monitor.md)")
    nccl_timing: NcclTimingMode = _key(NcclTimingMode.AUTO, "TORCH_NCCL_ENABLE_TIMING for NCCL ranks when the user has not set it: `auto` = on "
                                    "unless CUDA_DEVICE_MAX_CONNECTIONS=1 (timing events would break comm/compute "
                                    "overlap) (docs/nccl_timing.md)")
    budget_pct: float = _key(BUDGET_PCT, "share of step time placement may take (the step hook and the CPU of every "
                                         "thread of its own, tuner or not); above it the hot threads' counters are read "
                                         "every k-th step (monitor/probes/budget.py) and NCCL's flight recorder is polled "
                                         "less often (monitor/comm/nccl.py FrCadence), then the hand-overs are stretched "
                                         "(handover_max_s); 0 = every step, in the step hook")
    hang_factor: float = _key(10.0, "a rank that completes no step for max(hang_factor x its median step, "
                                    "hang_min_s) seconds is hung: a `stall` event names where its main thread waits")
    hang_min_s: float = _key(7.0, "the floor of that hang limit, in seconds")
    hang_pause_s: float = _key(120.0, "a rank of many hung outside any collective is named at once by rank 0 "
                                      "when peers wait for it; its own `stall` event waits this long, as every "
                                      "rank pausing together (a checkpoint) is not a fault")
    residence_every_s: float = _key(60.0, "seconds between looks at where the rank's memory pages are (a move_pages "
                                          "sample on the monitor thread, docs/monitor.md); 0 = off")
    residence_min_pct: float = _key(90.0, "share of the rank's resident pages on its planned NUMA node(s) below which "
                                          "a `warning` event names where the others are")


@dataclass
class TuneConfig:
    enabled: bool = _key(True, "the self-tuner: moves threads when the evidence says a better core exists")
    dry_run: bool = _key(False, "log what it would do, change nothing")
    window: int = _key(20, "steps per evaluation window, at least (window_min_s)")
    window_min_s: float = _key(0.5, "least time a window covers: at shorter steps a window is `window` x 2^k steps "
                                    "(the fewest that last this long at the last window's median step), ending at "
                                    "the monitor's paced hand-overs; 0 = `window` steps always")
    rules: list[str] = _key(list(TUNE_RULES), "the rules it asks (docs/tuning.md)")
    runq_wait_pct: float = _key(10.0, "hot thread runqueue wait, % of step time, that triggers a move")
    comm_share_pct: float = _key(30.0, "comm share of step above which NCCL threads get their own core")
    data_share_pct: float = _key(20.0, "data wait share of step above which the dataloader set grows")
    min_gain_pct: float = _key(2.0, "an action must beat the noise band by this much to be kept")
    cooldown_windows: int = _key(1, "windows to wait after an action before the next")
    max_backoff_windows: int = _key(16, "cap of the exponential back-off after rollbacks")
    background_nice: int = _key(5, "nice value given to background roles (0 = leave alone)")


@dataclass
class MetricsConfig:
    port: int = _key(0, "serve Prometheus `/metrics` on this port: under placerun one endpoint per node (its agent), "
                        "under attach() one per rank on port + local rank; 0 = off (a drop-in opens no port unasked)")
    textfile_dir: str = _key("", "write the same metrics into this directory for node_exporter's textfile collector "
                                 "(`placement.prom` per node under placerun, `placement_rank<R>.prom` per rank "
                                 "otherwise; temp file + rename); empty = off")
    per_rank: bool = _key(True, "a series per rank; false = each node's ranks summed (sites that cannot hold per-rank "
                                "series of a 16,384-rank job, docs/monitor.md)")
    publish_every_s: float = _key(1.0, "seconds between a rank's updates of what the endpoint or textfile shows")


@dataclass
class PlacementConfig:
    policy: Policy = _key(Policy.AUTO, "how CPUs are shared out: per thread role (`auto`) or one set per process (docs/plan.md)")
    memory: MemoryMode = _key(MemoryMode.BIND, "each rank's memory policy on its NUMA node; stepped down when a container refuses it")
    reserved_cpus: str = _key("", "kernel cpu list of housekeeping CPUs never used, e.g. `0,1`")
    smt: SmtMode = _key(SmtMode.AVOID, "`avoid`: hot roles get a whole core, one thread per core used; `use`: SMT siblings too")
    prefer_fast_cores: bool = _key(True, "hot roles on the cores of lowest `perf_rank`")
    strict: bool = _key(False, "`true`: refuse a plan that cannot be met (one line, exit 2) instead of running "
                               "a degraded plan with warnings")
    dataloader_workers: int = _key(2, "DataLoader workers per rank the plan sizes for")
    nccl_topo_file: str = _key("", "NCCL topology XML whose GPU/NIC/NUMA facts win over sysfs (cloud VMs); "
                                   "empty = `$NCCL_TOPO_FILE` if set")
    monitor: MonitorConfig = field(default_factory=MonitorConfig,
                                   metadata={"doc": "per-step records in <log_dir>/rank<R>.jsonl"})
    tune: TuneConfig = field(default_factory=TuneConfig,
                             metadata={"doc": "the self-tuner: moves threads when a window's figures say it pays"})
    metrics: MetricsConfig = field(default_factory=MetricsConfig,
                                   metadata={"doc": "live metrics for Prometheus (docs/monitor.md, live metrics)"})

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (a choice as its text), as YAML and JSON hold them."""
        return dataclasses.asdict(self, dict_factory=lambda items: {k: _plain(v) for k, v in items})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlacementConfig":
        return load_config(base=d)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Vocabulary) else value


def _choices(key: str, value: Any, valid: Iterable[str]) -> None:
    if value not in valid:
        raise ConfigError(f"placement.{key}={_shown(value)} is not valid; choose one of: {', '.join(valid)}")


def _range(key: str, value: float, lo: float, hi: float | None = None) -> None:
    if not value >= lo or (hi is not None and not value <= hi):  # NaN fails both comparisons
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"placement.{key}={_shown(value)} is out of range; valid: {rng}")


def validate(cfg: PlacementConfig) -> PlacementConfig:
    """Check every value; raise ConfigError with one line naming the value and the valid choices."""
    for key, kind in CHOICES.items():
        if isinstance(kind, type):  # a choice field: a member of its set, given as one or as its text
            *parents, leaf = key.split(".")
            node = cfg
            for name in parents:
                node = getattr(node, name)
            _choices(key, getattr(node, leaf), kind.values())
            setattr(node, leaf, kind(getattr(node, leaf)))
    try:
        parse_cpulist(cfg.reserved_cpus)
    except ValueError as e:
        raise ConfigError(f"placement.reserved_cpus={_shown(cfg.reserved_cpus)} is not a cpu list ({e}); "
                          f"valid: a kernel cpu list of ids below {MAX_CPUS} such as '0,1' or '0-3,64-67'") from None
    _range("dataloader_workers", cfg.dataloader_workers, 0, MAX_DATALOADER_WORKERS)
    m = cfg.monitor
    if not m.log_dir.strip() or "\x00" in m.log_dir:
        raise ConfigError(f"placement.monitor.log_dir={_shown(m.log_dir)} is not valid; valid: a directory path, "
                          "e.g. placement_logs (empty would write into the working directory)")
    if "\x00" in cfg.nccl_topo_file:
        raise ConfigError(f"placement.nccl_topo_file={_shown(cfg.nccl_topo_file)} is not valid; "
                          "valid: a file path or empty")
    for k in ("flush_every", "rescan_every"):
        _range(f"monitor.{k}", getattr(m, k), 1, 1_000_000)
    _range("monitor.handover_min_s", m.handover_min_s, 0.0, 60.0)
    _range("monitor.handover_max_s", m.handover_max_s, 0.0, 600.0)
    _range("monitor.exchange_min_s", m.exchange_min_s, 0.0, 600.0)
    _range("monitor.record_min_s", m.record_min_s, 0.0, 60.0)
    _range("monitor.exchange_every", m.exchange_every, 1, 10_000)  # the exchange holds this many steps per rank
    _range("monitor.summary_every", m.summary_every, 0, 1_000_000)
    _range("monitor.digest_every", m.digest_every, 0, 1_000_000)
    if m.log_rotate_mb != 0:
        _range("monitor.log_rotate_mb", m.log_rotate_mb, 0.01, 1 << 20)
    _range("monitor.straggler_min_cost_pct", m.straggler_min_cost_pct, 0.0, 100.0)
    _range("monitor.straggler_confirm_windows", m.straggler_confirm_windows, 1, 1000)
    _range("monitor.straggler_steady_pct", m.straggler_steady_pct, 0.0, 100.0)
    _range("monitor.straggler_persist_windows", m.straggler_persist_windows, 1, 1000)
    _range("monitor.budget_pct", m.budget_pct, 0.0, 100.0)
    _range("monitor.hang_factor", m.hang_factor, 1.0, 1000.0)
    _range("monitor.hang_min_s", m.hang_min_s, 0.1, 86400.0)
    _range("monitor.hang_pause_s", m.hang_pause_s, 0.0, 86400.0)
    if m.residence_every_s != 0:
        _range("monitor.residence_every_s", m.residence_every_s, 1.0, 86400.0)
    _range("monitor.residence_min_pct", m.residence_min_pct, 0.0, 100.0)
    x = cfg.metrics
    _range("metrics.port", x.port, 0, 65535)
    if "\x00" in x.textfile_dir:
        raise ConfigError(f"placement.metrics.textfile_dir={_shown(x.textfile_dir)} is not valid; "
                          "valid: a directory path or empty")
    _range("metrics.publish_every_s", x.publish_every_s, 0.1, 3600.0)
    t = cfg.tune
    for r in t.rules:
        _choices("tune.rules", r, TUNE_RULES)
    _range("tune.window", t.window, 2, 10000)
    _range("tune.window_min_s", t.window_min_s, 0.0, 60.0)
    for k in ("runq_wait_pct", "comm_share_pct", "data_share_pct"):
        _range(f"tune.{k}", getattr(t, k), 0.0, 100.0)
    _range("tune.min_gain_pct", t.min_gain_pct, 0.0, 100.0)
    _range("tune.cooldown_windows", t.cooldown_windows, 0, 1000)
    _range("tune.max_backoff_windows", t.max_backoff_windows, 1, 100000)
    _range("tune.background_nice", t.background_nice, 0, 19)
    return cfg


def load_config(overrides: Iterable[str] = (), config_file: str | None = None,
                base: dict[str, Any] | Sequence[dict[str, Any] | str] | None = None) -> PlacementConfig:
    """Build a validated PlacementConfig from defaults, then a YAML file, then a dict (or a
    sequence of dicts and YAML file paths, each over the one before), then dotted overrides
    ("placement.policy=exclusive" or "policy=exclusive").

    The YAML file may hold the keys at top level or under a `placement:` key. Plain dataclass
    code, no OmegaConf: placerun pays for this on every launch.
    """
    cfg = PlacementConfig()
    if config_file is not None:  # "" too: an empty --placement-config is an error, not no file
        _merge(cfg, read_config_file(config_file), config_file)
    for layer in ([base] if isinstance(base, dict) else base or ()):
        if isinstance(layer, str):  # a YAML file among the layers
            _merge(cfg, read_config_file(layer), layer)
        else:
            _merge(cfg, layer, "arguments")
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {_shown(o)} is not KEY=VALUE; e.g. placement.policy=exclusive")
        key, value = o.split("=", 1)
        key = key.strip().lstrip("+")
        if key.startswith("placement."):
            key = key[len("placement."):]
        _set(cfg, key.split("."), _parse_scalar(value), "overrides", from_text=True)
    return validate(cfg)


# Settings without code, for a process no command line reaches (a Ray worker: its setup hook
# takes no arguments) and, the same, for placerun and attach(): placerun's override words and a
# --placement-config file. Beneath what the command line or attach()'s arguments say.
OVERRIDES_ENV = "PLACEMENT_OVERRIDES"
CONFIG_ENV = "PLACEMENT_CONFIG"


@dataclasses.dataclass(frozen=True)
class EnvSettings:
    words: tuple[str, ...]  # PLACEMENT_OVERRIDES split as a shell splits it
    config_file: str | None  # PLACEMENT_CONFIG

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> "EnvSettings":
        """ConfigError (one line naming the variable) when the words do not split."""
        import shlex

        text = environ.get(OVERRIDES_ENV, "")
        try:
            words = tuple(shlex.split(text))
        except ValueError as e:
            raise ConfigError(f"{OVERRIDES_ENV}={_shown(text)} does not split into words ({e}); give "
                              "placement.KEY=VALUE words separated by spaces") from None
        return cls(words, environ.get(CONFIG_ENV) or None)

    def __bool__(self) -> bool:
        return bool(self.words) or self.config_file is not None

    def load(self, overrides: Sequence[str] = (), config_file: str | None = None) -> PlacementConfig:
        """The config of a command line (placerun, `placement plan`) over these: files first (this
        one, then `config_file`), then words (these, then `overrides`). A bad setting here is named
        with its variable."""
        try:
            return load_config([*self.words, *overrides], self.config_file,
                               base=None if config_file is None else [config_file])
        except ConfigError:
            if self:
                self.config()  # raises, naming the variable, when the bad setting is the environment's
            raise

    def config(self) -> PlacementConfig:
        """The config they make; ConfigError (one line, naming the variable) when it is not valid."""
        try:
            return load_config(self.words, self.config_file)
        except ConfigError as e:
            given = [f"{CONFIG_ENV}={self.config_file!r}"] if self.config_file is not None else []
            given += [f"{OVERRIDES_ENV}={' '.join(self.words)!r}"] if self.words else []
            raise ConfigError(f"{', '.join(given)}: {e}") from None


def read_config_file(path: str) -> dict[str, Any]:
    """The placement keys of a YAML file (top level or under `placement:`); one-line errors."""
    import yaml  # third-party, needed only when a file is given

    try:
        text = read_bounded(path, CONFIG_FILE_MAX).decode("utf-8")  # bounded; a FIFO is refused, not waited on
        loaded = yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"cannot read placement config file {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"placement config file {path!r} is not UTF-8 text (byte {e.start}: "
                          f"{e.object[e.start:e.start + 1]!r}); give a YAML file of placement keys") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"placement config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"placement config file {path!r} is nested too deeply to be a placement config") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"placement config file {path!r} must hold a mapping of placement keys, "
                          f"not {type(loaded).__name__}")
    if "defaults" in loaded:
        raise ConfigError(f"placement config file {path!r} is a Hydra primary config (its `defaults:` list is "
                          "composed by Hydra); give --placement-config a plain file of placement keys, e.g. a copy "
                          f"of {EXAMPLE_CONFIG}")
    package = _hydra_package(text)
    if package is not None:  # a Hydra group file (configs/placement/tune/off.yaml): its keys sit there
        if package != "placement" and not package.startswith("placement."):
            raise ConfigError(f"placement config file {path!r} is a Hydra config of package {package!r}, "
                              "not of placement; valid: placement or placement.<subtree>")
        for part in reversed(package.split(".")[1:]):
            loaded = {part: loaded}
        return loaded
    if set(loaded) == {"placement"} and isinstance(loaded["placement"], dict):
        loaded = loaded["placement"]
    return loaded


EXAMPLE_CONFIG = "configs/placement.example.yaml"  # every key, its default, one comment each


def _hydra_package(text: str) -> str | None:
    """The `# @package X` directive of a Hydra config file's header, read as Hydra reads it
    (hydra/plugins/config_source.py, ConfigSource._get_header_dict, hydra-core 1.3: leading lines
    starting `# @`, blank lines skipped, the first other line ends the header)."""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not line.startswith("#") or not line.lstrip("#").strip().startswith("@"):
            return None
        key, _, value = line.lstrip("#").strip().partition(" ")
        if key == "@package" and value.strip():
            return value.strip()
    return None


def _merge(node: Any, layer: dict[str, Any], where: str, prefix: tuple[str, ...] = ()) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(getattr(node, str(key), None)):
            _merge(getattr(node, key), value, where, prefix + (key,))
        else:
            _set(node, [str(key)], value, where, prefix=prefix)


def _set(node: Any, path: list[str], value: Any, where: str, *, prefix: tuple[str, ...] = (),
         from_text: bool = False) -> None:
    """Set one key, converting and type-checking the value against the dataclass field."""
    path = _renamed(prefix, path)
    *parents, leaf = path
    for name in parents:
        child = getattr(node, name, None) if name in _field_types(node) else None
        if not dataclasses.is_dataclass(child):
            _unknown(prefix + tuple(path), where)
        node, prefix = child, prefix + (name,)
    types = _field_types(node)
    if leaf not in types:
        _unknown(prefix + (leaf,), where)
    full = "placement." + ".".join(prefix + (leaf,))
    current = getattr(node, leaf)
    if dataclasses.is_dataclass(current):
        raise ConfigError(f"bad value for {full} (from {where}): {_shown(value)} is not a mapping of its keys; "
                          f"valid keys: {', '.join(_all_keys(type(current), full + '.'))}")
    setattr(node, leaf, _convert(types[leaf], value, full, where, from_text))


def _renamed(prefix: tuple[str, ...], path: list[str]) -> list[str]:
    """`path` under `prefix`, an old name (RENAMED_KEYS) put to its new one, said once."""
    old = ".".join(prefix + tuple(path))
    new = RENAMED_KEYS.get(old)
    if new is None:
        return path
    if old not in _said_renamed:
        _said_renamed.add(old)
        sys.stderr.write(f"placement: placement.{old} is now placement.{new}; the old name is read for one "
                         f"more release\n")
    return new.split(".")[len(prefix):]


def _field_types(node: Any) -> dict[str, Any]:
    return _class_field_types(type(node))


@functools.lru_cache(maxsize=None)
def _class_field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)  # resolves the annotations `from __future__` left as strings
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _parse_scalar(text: str) -> Any:
    """An override's value as text: lists "[a,b]" split, quotes stripped; typed later per field."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [v.strip().strip("'\"") for v in text[1:-1].split(",") if v.strip()]
    return text


def _convert(kind: Any, value: Any, full: str, where: str, from_text: bool) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"bad value for {full} (from {where}): {_shown(value)} is not {expected}")

    if kind is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise bad("a boolean (true or false)")
    if kind in (int, float):
        # bool is an int to Python, never a number to a user; a float is no integer.
        accepted = (int,) if kind is int else (int, float)
        if from_text and isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                pass
        if isinstance(value, accepted) and not isinstance(value, bool):
            try:
                converted = kind(value)
            except OverflowError:  # an integer too large for a float
                raise bad("a finite number") from None
            if kind is float and not math.isfinite(converted):
                raise bad("a finite number")
            return converted
        raise bad("an integer" if kind is int else "a number")
    if kind is str or (isinstance(kind, type) and issubclass(kind, Vocabulary)):
        if isinstance(value, str):  # a choice is checked against its set, and made a member, by validate()
            return value
        if full == "placement.reserved_cpus" and isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # reserved_cpus: 3 in YAML; a number is never a path or a choice
        raise bad("a string")
    # list[str]
    if isinstance(value, str) and from_text:
        value = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise bad("a list of names")


def _subconfigs(cls: type) -> dict[str, type]:
    return {"monitor": MonitorConfig, "tune": TuneConfig, "metrics": MetricsConfig} if cls is PlacementConfig else {}


# Keys whose values are a closed set: a Vocabulary (the field holds a member), or the tuple of
# names a list key takes (tune.rules: the rules' own names, tune/rules/__init__.py).
CHOICES: dict[str, Any] = {"policy": Policy, "memory": MemoryMode, "smt": SmtMode,
                           "monitor.comm_timing": CommTimingMode, "monitor.nccl_timing": NcclTimingMode,
                           "tune.rules": TUNE_RULES}


def choice_values(key: str) -> tuple[str, ...]:
    """The valid values of a closed-set key, in order."""
    kind = CHOICES[key]
    return kind.values() if isinstance(kind, type) else tuple(kind)


def valid_values(key: str) -> str:
    """What `key` ("placement.policy" or "policy") takes, in words: its choices, its type, or
    (for an unknown key) the valid keys."""
    key = key.lstrip("+").removeprefix("placement.")
    if key in CHOICES:
        return "choose one of: " + ", ".join(choice_values(key))
    node: Any = PlacementConfig
    *parents, leaf = key.split(".")
    for name in parents:
        node = _subconfigs(node).get(name)
        if node is None:
            break
    types = _class_field_types(node) if node is not None else {}
    if leaf not in types or dataclasses.is_dataclass(types[leaf]):
        return "valid keys: " + ", ".join(_all_keys(PlacementConfig))
    kind = types[leaf]
    return {bool: "valid: true or false", int: "valid: an integer", float: "valid: a number",
            str: "valid: a string"}.get(kind, "valid: a list of names")


def _unknown(path: tuple[str, ...], where: str) -> None:
    valid = ", ".join(_all_keys(PlacementConfig))
    raise ConfigError(f"unknown key placement.{'.'.join(path)} (from {where}); valid keys: {valid}")


def _all_keys(cls: type, prefix: str = "placement.") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        sub = _subconfigs(cls).get(f.name)
        if sub is not None:
            out.extend(_all_keys(sub, prefix + f.name + "."))
        else:
            out.append(prefix + f.name)
    return out


def is_setting(key: str) -> bool:
    """`key` ("placement.policy", "+placement.monitor") names a setting or a group of them."""
    key = key.lstrip("+")
    if key.startswith("placement.") and key[len("placement."):] in RENAMED_KEYS:
        return True
    return any(k == key or k.startswith(key + ".") for k in _all_keys(PlacementConfig))


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(value) + "]"
    return '""' if value == "" else str(value)


def keys_table() -> str:
    """Every key, its default and its description as a Markdown table (README's, which
    tests/test_readme.py holds equal to this; `python -m placement.config` prints it)."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(cls: type, prefix: str) -> None:
        instance = cls()
        for f in dataclasses.fields(cls):
            if f.name in _subconfigs(cls):
                walk(_subconfigs(cls)[f.name], f"{prefix}{f.name}.")
                continue
            key = prefix + f.name
            doc = f.metadata["doc"]
            choices = choice_values(key) if key in CHOICES else None
            if choices:
                doc += ("; any of " if f.type == "list[str]" else "; one of ") + ", ".join(f"`{c}`" for c in choices)
            rows.append(f"| `placement.{key}` | `{_default_text(getattr(instance, f.name))}` | {doc} |")

    walk(PlacementConfig, "")
    return "\n".join(rows)


_EXAMPLE_HEAD = f"""\
# A plain placement config: every key with its default value. Copy it, change what you need, drop the rest:
#   placerun --placement-config my_placement.yaml train.py     or     placement.attach(config="my_placement.yaml")
# (The files under configs/placement/ are Hydra configs for Hydra apps; see README "Hydra apps".)
# Generated from placement/config.py by `python -m placement.config --example > {EXAMPLE_CONFIG}`."""
_EXAMPLE_COLUMN = 26  # where the comments start


def _yaml_text(value: Any) -> str:
    """`value` as YAML that reads back as itself (a string YAML would take for another type is quoted)."""
    import yaml  # third-party, needed only here

    text = _default_text(value)
    return text if yaml.safe_load(text) == _plain(value) else json.dumps(str(value))


def example_yaml() -> str:
    """configs/placement.example.yaml: every key, its default and its description as a comment
    (tests/test_config.py holds the file equal to this)."""
    lines = _EXAMPLE_HEAD.splitlines()

    def walk(cls: type, indent: str, prefix: str) -> None:
        instance = cls()
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            doc = f.metadata["doc"]
            sub = _subconfigs(cls).get(f.name)
            if sub is not None:
                lines.append(f"{indent}{f.name}:".ljust(_EXAMPLE_COLUMN) + f"# {doc}")
                walk(sub, indent + "  ", key + ".")
                continue
            if key in CHOICES:
                doc += ("; any of " if f.type == "list[str]" else "; one of ") + " | ".join(choice_values(key))
            line = f"{indent}{f.name}: {_yaml_text(getattr(instance, f.name))}"
            lines.append(line.ljust(_EXAMPLE_COLUMN - 1) + f" # {doc}")

    walk(PlacementConfig, "", "")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # README's keys table; with --example, configs/placement.example.yaml
    sys.stdout.write(example_yaml() if sys.argv[1:] == ["--example"] else keys_table() + "\n")
