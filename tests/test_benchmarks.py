"""The benchmarks that reach into the monitor by name still find what they time: a re-cut that
moves a method must move the benchmark with it (benchmarks/monitor_thread.py timed nothing after
the monitor's re-cut until this test)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_part_monitor_thread_times_is_still_where_it_looks_and_callable():
    bench = _load("monitor_thread")
    parts = bench.timed_parts()
    assert len(parts) == len(bench.LABELS)
    for owner, name in parts:
        assert callable(getattr(owner, name, None)), f"{owner.__name__}.{name} is gone: move the benchmark with it"
