"""A test bed of hosts on this machine: each host is a network namespace plus a UTS namespace
(its own hostname) with one address on a private bridge, so rendezvous, the c10d store and gloo
cross a real network stack between distinct addresses, and each host can be frozen or killed
as a whole.

    bed = HostBed.create(2)                  # hosts bed.hosts[0..1], addresses 10.213.0.1, .2
    proc = bed.hosts[0].start([python, "-c", "..."], tmp_path / "h0")
    bed.hosts[1].freeze(); bed.hosts[1].thaw(); bed.hosts[1].kill()
    bed.close()                              # every process of every host killed, namespaces gone

Layout: namespace `<prefix>-br` holds the bridge `br0` and one veth end per host (`v<i>`); each
host namespace `<prefix>-h<i>` holds the other end, named `eth0`, and `lo`. Nothing is added to
the machine's own network namespace, so the bed can neither reach nor disturb the machine's
network. `<prefix>` is `pltbed-<pid of the test process>-<n>`: a bed whose creator is gone (a
run killed before its finalizer ran) is removed by the next `HostBed.create` (`remove_leftovers`).

A process runs in a host as `ip netns exec NS unshare --uts -- python hostbed_exec.py HOSTNAME
PROG ARGS` (argv lists, no shell): the small helper sets the hostname in the new UTS namespace and
execs the program. "Every process of a host" is every process whose network namespace is the
host's (read from /proc/<pid>/ns/net), so a host's processes are found even after they detach.
Names resolve as on a cluster with an /etc/hosts: `ip netns exec` binds /etc/netns/NS/hosts (every
host's name and address, written by the bed) over /etc/hosts (torch elastic resolves the rendezvous
endpoint and its own hostname; gloo is pointed at eth0 with GLOO_SOCKET_IFNAME, `Host.env`).

Machine facts per host: `Host.machine_root` (a tree made by tests/sysfs_builder.py) is handed to
placerun through PLACEMENT_TEST_MACHINE_ROOT (placement/launcher.py; tests only, docs/development.md);
`Host.cpus` keeps every process of the host on CPUs of its own (sched_setaffinity in the helper).
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

PREFIX = "pltbed-"
SUBNET = "10.213.0"  # inside the bed's own namespaces only; the machine never routes to it
EXEC_HELPER = Path(__file__).resolve().with_name("hostbed_exec.py")
_counter = itertools.count()


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=timeout)


def unavailable() -> Optional[str]:
    """Why a host bed cannot be built here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "host test bed needs root (network and UTS namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"host test bed needs `{tool}` (iproute2 / util-linux), not found on PATH"
    probe = f"{PREFIX}probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"host test bed: `ip netns add` refused ({made.stderr.strip() or made.returncode})"
        try:
            uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "--", sys.executable, "-c",
                                  "import socket; socket.sethostname('probe')"],
                                 capture_output=True, text=True, timeout=30)
            if uts.returncode != 0:
                return f"host test bed: a UTS namespace is not allowed ({uts.stderr.strip()[-200:]})"
        finally:
            _ip("netns", "del", probe, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"host test bed: namespaces are not usable here ({e})"
    return None


def _netns_inode(ns: str) -> Optional[int]:
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return None


def pids_in_netns(ns: str) -> list[int]:
    """Every process whose network namespace is `ns` (none when the name is gone)."""
    ino = _netns_inode(ns)
    if ino is None:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                out.append(int(entry))
        except OSError:
            pass  # exited meanwhile
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_netns(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL (and SIGCONT, for a frozen host) every process of `ns` until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = pids_in_netns(ns)
        if not pids or time.monotonic() > deadline:
            return
        _signal_all(pids, signal.SIGKILL)
        _signal_all(pids, signal.SIGCONT)
        time.sleep(0.05)


def _creator_alive(name: str) -> bool:
    """`pltbed-<pid>-...`: is the process that made this bed still running?"""
    try:
        pid = int(name[len(PREFIX):].split("-", 1)[0])
    except ValueError:
        return False
    return os.path.exists(f"/proc/{pid}")


def _remove_netns(ns: str) -> None:
    _kill_netns(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def remove_leftovers() -> list[str]:
    """Remove beds (namespaces and their processes) left by a run that was killed: those whose
    creating process is gone. Returns the namespaces removed."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        ns = line.split(" ", 1)[0].strip()
        if ns.startswith(PREFIX) and not _creator_alive(ns):
            _remove_netns(ns)
            removed.append(ns)
    return removed


@dataclass
class Host:
    index: int
    name: str  # its hostname
    netns: str
    addr: str
    machine_root: Optional[str] = None  # this host's machine facts for placerun (tests only)
    cpus: Optional[frozenset[int]] = None  # this host's own cores (its processes' affinity); None: all
    started: list = field(default_factory=list)

    def argv(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside this host: its network namespace, a new UTS namespace, its hostname
        (and its own cores, when the bed gave it some)."""
        from placement.cpuset import format_cpulist

        own = ["--cpus", format_cpulist(self.cpus)] if self.cpus else []
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", sys.executable, str(EXEC_HELPER),
                *own, self.name, *cmd]

    def env(self, extra: Optional[dict] = None) -> dict:
        """This test's environment without placement's own variables (a launcher hands those to
        its workers), plus `extra`, the host's GLOO_SOCKET_IFNAME and its machine tree."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PLACEMENT_", "OMP_NUM_THREADS"))}
        env.update(extra or {})
        env.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        if self.machine_root:
            env["PLACEMENT_TEST_MACHINE_ROOT"] = self.machine_root
        return env

    def start(self, cmd: list[str], log_prefix: Path, env: Optional[dict] = None, cwd=None) -> subprocess.Popen:
        """Start `cmd` on this host, its stdout/stderr in <log_prefix>.out/.err."""
        with open(f"{log_prefix}.out", "w") as out, open(f"{log_prefix}.err", "w") as err:
            proc = subprocess.Popen(self.argv(cmd), stdout=out, stderr=err, env=self.env(env), cwd=cwd,
                                    start_new_session=True)
        self.started.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float = 60.0, env: Optional[dict] = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout, env=self.env(env))

    def pids(self) -> list[int]:
        return pids_in_netns(self.netns)

    def freeze(self) -> list[int]:
        """SIGSTOP every process of this host (as a host that hangs: nothing of it runs)."""
        pids = self.pids()
        _signal_all(pids, signal.SIGSTOP)
        return pids

    def thaw(self) -> None:
        _signal_all(self.pids(), signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL every process of this host (as a host that dies), then reap the ones we started."""
        _kill_netns(self.netns)
        for p in self.started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@dataclass
class HostBed:
    prefix: str
    hosts: list[Host]

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    @classmethod
    def create(cls, n: int, machine_roots: Optional[list[Optional[str]]] = None,
               cpus: Optional[list[frozenset[int]]] = None) -> "HostBed":
        """n hosts; host i reads machine_roots[i] as its machine facts and runs on cpus[i] (e.g.
        a core each, so one host's load does not land on another's core) where given."""
        if not 1 <= n <= 16:
            raise ValueError(f"hosts={n}: choose 1..16")
        remove_leftovers()
        prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        bed = cls(prefix, [])
        try:
            _ip("netns", "add", bed.bridge_ns)
            _ip("-n", bed.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", bed.bridge_ns, "link", "set", "br0", "up")
            _ip("-n", bed.bridge_ns, "link", "set", "lo", "up")
            for i in range(n):
                ns = f"{prefix}-h{i}"
                _ip("netns", "add", ns)
                bed.hosts.append(Host(i, f"host{i}", ns, f"{SUBNET}.{i + 1}",
                                      machine_roots[i] if machine_roots else None, cpus[i] if cpus else None))
                _ip("-n", bed.bridge_ns, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", bed.bridge_ns, "link", "set", f"v{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in bed.hosts)
            for h in bed.hosts:
                os.makedirs(f"/etc/netns/{h.netns}", exist_ok=True)
                Path(f"/etc/netns/{h.netns}/hosts").write_text(hosts)
        except BaseException:
            bed.close()
            raise
        return bed

    def close(self) -> None:
        """Kill every process of every host, remove every namespace of the bed (idempotent)."""
        for h in self.hosts:
            _kill_netns(h.netns)
            for p in h.started:
                if p.poll() is None:  # started but not yet inside the namespace when it was scanned
                    p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for ns in self.namespaces():
            _remove_netns(ns)

    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts] + [self.bridge_ns]


def hostbed_factory(request):
    """The body of the `hostbed` fixture (tests/conftest.py): a function making beds, each torn
    down at the test's end, pass or fail; skips with the reason where namespaces are not allowed."""
    why = unavailable()
    if why:
        pytest.skip(why)
    beds: list[HostBed] = []

    def make(n: int, machine_roots: Optional[list[Optional[str]]] = None,
             cpus: Optional[list[frozenset[int]]] = None) -> HostBed:
        bed = HostBed.create(n, machine_roots, cpus)
        beds.append(bed)
        return bed

    request.addfinalizer(lambda: [b.close() for b in beds])
    return make


def wait_until(pred, timeout: float, what: str, poll: float = 0.1, fail_if=None):
    """Poll `pred` until it returns something truthy (returned), at most `timeout` s; `fail_if`
    (a function returning an error text or None) ends the wait early with that text."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if fail_if is not None:
            err = fail_if()
            if err:
                raise AssertionError(f"while waiting for {what}: {err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
