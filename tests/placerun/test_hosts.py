"""Jobs across hosts of the test bed (tests/hostbed.py): each host has its own network namespace
(an address on a private bridge), hostname and, where a test gives it one, machine tree. placerun
runs on each host as on a cluster node: `--nnodes N --rdzv-backend c10d --rdzv-endpoint
<host0's address>:PORT`, 2 ranks per host on gloo.

- the bed itself: distinct names and addresses, TCP between hosts, nothing left after close, a
  killed run's leftovers removed;
- each host plans for its own machine (--dry-run names the host; another machine tree, another plan);
- a job across hosts: the banner and `start` events name each host, rank 0's `straggler` events
  name the slow rank's host and node rank, `placement report` over every host's logs shows hosts.
The host failures are in tests/placerun/test_host_failures.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostbed import PREFIX, HostBed, pids_in_netns, remove_leftovers, wait_until
from placement.cli import main as cli
from placerun_helpers import JOBS, launcher
from sysfs_builder import make_tree

PORT = 29400  # every bed has its own network: no port is shared with anything else


def job_cmd(bed: HostBed, host_index: int, tmp_path: Path, out: Path, *, steps: int, step_ms: float = 0.0,
            slow_rank: int = -1, slow_ms: float = 0.0, name: str = "placerun", overrides=(), torch_flags=(),
            nnodes: str = "") -> list[str]:
    """The launcher command of one host of a job of every host of `bed` (2 ranks each)."""
    placement = [] if name != "placerun" else [
        "placement.tune.enabled=false", "placement.monitor.exchange_every=10", "placement.monitor.summary_every=0",
        "placement.monitor.flush_every=5", f"placement.monitor.log_dir={tmp_path / f'logs-{bed.hosts[host_index].name}'}",
        *overrides]
    return [*launcher(name), "--nnodes", nnodes or str(len(bed.hosts)), "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{bed.hosts[0].addr}:{PORT}", "--rdzv-id", "hosts",
            "--monitor-interval", "0.2", *torch_flags, *placement,
            str(JOBS / "hosts_job.py"), str(out), str(steps), str(step_ms), str(slow_rank), str(slow_ms)]


def read_log(path: Path, strict: bool = True) -> list[dict]:
    """A rank's log records; `strict=False` skips a torn line (a write cut short by a full disk),
    as `placement report` does."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            if strict:
                raise
    return out


def host_logs(tmp_path: Path, bed: HostBed) -> dict[int, list[dict]]:
    """rank -> its log's records, from every host's log directory."""
    logs = {}
    for h in bed.hosts:
        for f in (tmp_path / f"logs-{h.name}").glob("rank*.jsonl"):
            logs[int(f.stem[4:])] = read_log(f)
    return logs


def err(prefix: Path, tail: int = 4000) -> str:
    """The end of a launcher's stderr (all of it with tail=0)."""
    return Path(f"{prefix}.err").read_text()[-tail:]


def test_hosts_have_their_own_name_address_and_reach_each_other(hostbed):
    bed = hostbed(2)
    names = [h.run([sys.executable, "-c", "import socket; print(socket.gethostname())"]).stdout.strip()
             for h in bed.hosts]
    assert names == ["host0", "host1"] and os.uname().nodename not in names
    addrs = [h.run(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout for h in bed.hosts]
    assert bed.hosts[0].addr in addrs[0] and bed.hosts[1].addr in addrs[1] and bed.hosts[1].addr not in addrs[0]
    # host1 serves one TCP connection; host0 connects to it by host1's name (the bed's hosts file)
    server = subprocess.Popen(bed.hosts[1].argv([sys.executable, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', 5000)); print('up', flush=True); "
        "c, a = s.accept(); c.sendall(socket.gethostname().encode() + b' ' + a[0].encode())")]),
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        got = bed.hosts[0].run([sys.executable, "-c", (
            "import socket; c = socket.create_connection(('host1', 5000), timeout=10); print(c.recv(100).decode())")],
            timeout=30)
        assert got.stdout.split() == ["host1", bed.hosts[0].addr], got.stderr
    finally:
        server.kill()
        server.wait(timeout=10)
    # the machine's own network has none of the bed's addresses
    assert bed.hosts[0].addr not in subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout



def test_a_host_given_cores_of_its_own_runs_every_process_there(hostbed):
    """HostBed.create(cpus=...): a host's processes, and what they start, run on its CPUs alone
    (read back from /proc), so one host's load does not land on another's core."""
    cpus = sorted(os.sched_getaffinity(0))
    own = [frozenset({cpus[0]}), frozenset({cpus[-1]})]
    bed = hostbed(2, cpus=own)
    child = "print([l for l in open('/proc/self/status') if l.startswith('Cpus_allowed_list')][0].split()[1])"
    code = f"import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); subprocess.run([sys.executable, '-c', {child!r}])"
    for host, want in zip(bed.hosts, own):
        got = host.run([sys.executable, "-c", code]).stdout.split()
        assert got == [str(sorted(want)), str(min(want))], got


def test_a_closed_bed_leaves_nothing_and_a_killed_runs_bed_is_removed(hostbed):
    bed = hostbed(2)
    sleeper = bed.hosts[1].start(["sleep", "600"], Path(os.devnull))
    # `ip netns exec` enters the namespace after start() returns: wait for it, bounded
    wait_until(lambda: pids_in_netns(bed.hosts[1].netns), 10, "the sleeper inside host1's namespace")
    bed.close()
    assert sleeper.wait(timeout=10) != 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in bed.namespaces())
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in bed.namespaces())
    # a bed whose creator died (a run killed before its finalizer): a process of it is still running
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = HostBed(f"{PREFIX}{dead.pid}-0", [])
    subprocess.run(["ip", "netns", "add", f"{orphan.prefix}-h0"], check=True)
    stray = subprocess.Popen(["ip", "netns", "exec", f"{orphan.prefix}-h0", "sleep", "600"])
    try:
        wait_until(lambda: pids_in_netns(f"{orphan.prefix}-h0"), 10, "the stray process inside its namespace")
        removed = remove_leftovers()
        assert f"{orphan.prefix}-h0" in removed and stray.wait(timeout=10) != 0
        assert f"{orphan.prefix}-h0" not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True).stdout
    finally:
        stray.kill()
        subprocess.run(["ip", "netns", "del", f"{orphan.prefix}-h0"], capture_output=True)


@pytest.mark.slow
def test_each_host_plans_for_its_own_machine(hostbed, tmp_path):
    """Host 0 is an 8-core one-node machine, host 1 a 16-vCPU VM with 2 nodes and 2 GPUs
    (tests/sysfs_builder.py): each host's --dry-run says which host it is and plans its own tree."""
    roots = [make_tree(tmp_path, "small_cpu"), make_tree(tmp_path, "vm_numa_minus_one")]
    bed = hostbed(2, roots)
    out = {}
    for h in bed.hosts:
        cmd = [*job_cmd(bed, h.index, tmp_path, tmp_path, steps=1)]
        cmd.insert(len(launcher("placerun")), "--dry-run")
        got = h.run(cmd, timeout=120)
        assert got.returncode == 0, got.stderr[-3000:]
        out[h.name] = got.stdout
    assert "host: host0" in out["host0"].splitlines() and "host: host1" in out["host1"].splitlines()
    table = {name: [line.split() for line in text.splitlines() if line[:1].isdigit()] for name, text in out.items()}
    # rank, gpu and numa of each rank's first line (host1's gpu column is "N (bus id)")
    assert [row[:3] for row in table["host0"]] == [["0", "-", "0"], ["1", "-", "0"]], out["host0"]
    assert [(row[0], row[1], row[3]) for row in table["host1"]] == [("0", "0", "0"), ("1", "1", "1")], out["host1"]


@pytest.mark.slow
def test_a_job_across_two_hosts_names_the_straggler_by_host(hostbed, tmp_path, capsys):
    bed = hostbed(2)
    slow = 3
    agents = [(h.start(job_cmd(bed, h.index, tmp_path, tmp_path, steps=60, slow_rank=slow, slow_ms=40),
                       tmp_path / h.name), tmp_path / h.name) for h in bed.hosts]
    for proc, prefix in agents:
        assert proc.wait(timeout=240) == 0, err(prefix)
    for h in bed.hosts:  # each agent's banner names its own host
        assert f"placerun: {h.name}: policy auto, 2 local rank(s)" in err(tmp_path / h.name, tail=0)  # the first line; torch may write 4 kB after it
    logs = host_logs(tmp_path, bed)
    assert sorted(logs) == [0, 1, 2, 3]
    start = {r: next(e for e in log if e["type"] == "start" and e.get("source") == "monitor")
             for r, log in logs.items()}
    where = {r: (s["host"], s["node_rank"]) for r, s in start.items()}
    assert {where[r][0] for r in (0, 1)} != {where[r][0] for r in (2, 3)}
    assert {h for h, _ in where.values()} == {"host0", "host1"}
    events = [e for e in logs[0] if e["type"] == "straggler" and e["steps"][0] > 10]
    named = [e for e in events if any(s["ranks"] == [slow] for s in e["stragglers"])]
    assert len(named) >= 3, events  # 11-20 .. 51-60 judged; a busy machine may cost one
    for e in named:
        assert e["hosts"][str(slow)] == where[slow][0] and e["nodes"][str(slow)] == where[slow][1], e
    assert f"rank(s) [{slow}] on {where[slow][0]} steps" in err(tmp_path / "host0", tail=0)  # said during the run, anywhere in it
    assert cli(["report", *(str(tmp_path / f"logs-{h.name}") for h in bed.hosts)]) == 0
    report = capsys.readouterr().out
    held = [line for line in report.splitlines() if line.strip().startswith("data-slow")]
    assert held and f"[node {where[slow][1]} ({where[slow][0]})" in held[0], report[-3000:]
