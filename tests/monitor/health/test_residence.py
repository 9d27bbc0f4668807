"""Memory residence (residence.py, monitor/health/residence.py): where a rank's pages are.

On this machine's real kernel (one NUMA node: every page on node 0) through move_pages(2) and
/proc/self/numa_maps; and on fixtures for many nodes through the readers' seams (a /proc root
with a crafted maps or numa_maps file, a `query` giving move_pages' answers), never by
patching the kernel's calls."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from placement import _procfs
from placement import residence
from placement.bind.memory import apply_memory_policy
from placement.cpuset import parse_cpulist
from placement.events import EventLog
from placement.monitor.health.residence import ResidenceWatch
from placement.plan.model import MemoryPolicy

REPO = Path(__file__).resolve().parents[3]
ONLINE = sorted(parse_cpulist(Path("/sys/devices/system/node/online").read_text().strip()))
needs_move_pages = pytest.mark.skipif(not _procfs.move_pages_supported(), reason="move_pages not known on this arch")


def _touched(mib: int) -> bytearray:
    buf = bytearray(mib << 20)
    buf[::4096] = b"\1" * len(buf[::4096])  # every page written: resident
    return buf


# ---- the real kernel ------------------------------------------------------------------------
@needs_move_pages
def test_the_sample_and_the_full_read_agree_on_this_machine(tmp_path):
    buf = _touched(64)
    sampled = residence.sample_process(ONLINE[:1])
    full = residence.read_process(ONLINE[:1])
    assert sampled.resident > 100 and full.resident >= 64 * 256, (sampled, full)
    assert set(sampled.by_node) <= set(ONLINE) and set(full.by_node) <= set(ONLINE)
    if len(ONLINE) == 1:  # this machine: one node, so every page is on it
        assert sampled.share_pct == full.share_pct == 100.0
        assert residence.below(sampled, 90.0) is None
    # A node that is not this machine's (as a plan for another host would say): nothing there.
    elsewhere = residence.sample_process([max(ONLINE) + 1])
    assert elsewhere.share_pct == 0.0 and residence.below(elsewhere, 90.0) is not None
    assert f"on node {ONLINE[0]}" in residence.below(elsewhere, 90.0)
    del buf


@needs_move_pages
def test_a_buffers_pages_are_asked_where_they_are_and_unmapped_ones_count_as_absent():
    import torch

    t = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB written
    buffers, pinned = residence.tensor_buffers({"x": [t, t[:10]], "y": (torch.zeros(0),)})
    assert (t.data_ptr(), 8 << 20) in buffers and pinned is False
    got = residence.sample_buffers("batch buffers", buffers, ONLINE[:1])
    assert got.resident >= 2048 and got.absent == 0, got
    assert set(got.by_node) <= set(ONLINE)
    # Never-touched memory has no page yet: asked, absent, not counted.
    import mmap

    m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    statuses = _procfs.move_pages_query([addr, addr + 4096])
    assert statuses == [-errno.ENOENT, -errno.ENOENT], statuses
    del addr
    m.close()


@needs_move_pages
def test_another_process_is_asked_by_pid_and_a_gone_one_is_said_in_one_line():
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(32 << 20); b[::4096] = b'1' * (8192); "
                              "sys.stdout.write('ok\\n'); sys.stdout.flush(); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ok\n"
        got = residence.sample_process(ONLINE[:1], pid=child.pid)
        assert got.resident > 0 and set(got.by_node) <= set(ONLINE)
    finally:
        child.stdin.close()
        child.wait()
    res, why = residence.safe(lambda: residence.sample_process([0], pid=child.pid))
    assert res is None and why == "the process exited"


def test_the_start_of_run_memory_event_says_where_the_pages_are(tmp_path):
    pytest.importorskip("numa", reason="py-libnuma applies the policy")
    box = {}

    def run():  # a policy is per thread: set it on a throwaway thread
        ev = EventLog(str(tmp_path / "rank0.jsonl"), rank=0)
        try:
            box["out"] = apply_memory_policy(MemoryPolicy("bind", ONLINE[:1]), ev)
        finally:
            ev.close()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    event = next(json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()
                 if json.loads(line)["type"] == "memory")
    r = event["resident"]
    assert r["source"] == "move_pages" and r["planned"] == ONLINE[:1] and r["asked"] > 0, event
    assert sum(r["by_node"].values()) > 0
    if len(ONLINE) == 1:
        assert r["share_pct"] == 100.0
    assert box["out"].resident is not None


# ---- fixtures: many nodes -------------------------------------------------------------------
MAPS = b"""\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
00652000-00653000 rw-p 00052000 08:02 173521      /usr/bin/python3
01000000-01400000 rw-p 00000000 00:00 0           [heap]
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
7f0000400000-7f0040000000 ---p 00000000 00:00 0
7f1000000000-7f1000100000 rw-s 00000000 00:01 4242   /dev/zero (deleted)
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0           [stack]
7ffc00100000-7ffc00102000 r--p 00000000 00:00 0           [vvar]
"""

NUMA_MAPS = b"""\
00400000 default file=/usr/bin/python3 mapped=82 N0=40 N1=42 kernelpagesize_kB=4
01000000 default heap anon=1024 dirty=1024 N0=256 N3=768 kernelpagesize_kB=4
7f0000000000 bind:2-3 anon=1024 dirty=1024 N2=1024 kernelpagesize_kB=4
7f2000000000 default anon=4 dirty=4 N1=4 kernelpagesize_kB=2048
7ffc00000000 default stack anon=33 dirty=33 N0=33 kernelpagesize_kB=4
"""


def _fake_proc(tmp_path: Path, name: str, raw: bytes) -> str:
    (tmp_path / "77").mkdir(exist_ok=True)
    (tmp_path / "77" / name).write_bytes(raw)
    return str(tmp_path)


def test_maps_parser_keeps_the_private_anonymous_data_mappings_only(tmp_path):
    entries = _procfs.maps(77, _fake_proc(tmp_path, "maps", MAPS))
    data = [(e.start, e.path) for e in entries if e.anon_data]
    assert data == [(0x01000000, "[heap]"), (0x7f0000000000, ""), (0x7ffc00000000, "[stack]")]
    with pytest.raises(ValueError):
        _procfs.parse_maps(b"zz-yy rw-p 0 0 0\n")


def test_a_sample_on_four_nodes_names_where_the_pages_off_the_plan_are(tmp_path):
    proc = _fake_proc(tmp_path, "maps", MAPS)
    heap = range(0x01000000, 0x01400000)

    def query(addresses):  # the seam: move_pages' answers for a 4-node host
        out = []
        for a in addresses:
            if a in heap:
                out.append(3)  # the heap was touched before binding, on node 3
            elif a >= 0x7ffc00000000:
                out.append(-errno.ENOENT)  # stack pages not touched
            else:
                out.append(1)
        return out

    got = residence.sample_process([0, 1], pid=77, proc=proc, pages=512, query=query)
    # 4 MiB heap + 4 MiB anon + 132 KiB stack = 2081 pages; 512 spread in proportion.
    assert got.asked == 512 and got.absent == pytest.approx(512 * 33 / 2081, abs=2)
    assert got.by_node[3] == pytest.approx(512 * 1024 / 2081, abs=2)
    assert got.share_pct == pytest.approx(50.0, abs=1.0)
    assert got.elsewhere() == {3: pytest.approx(50.0, abs=1.0)}
    warning = residence.below(got, 90.0)
    assert warning is not None and "on node 3" in warning and "node 0-1" in warning, warning
    assert residence.below(got, 40.0) is None
    d = got.to_dict()
    assert d["by_node"] == {"1": got.by_node[1], "3": got.by_node[3]} and d["planned"] == [0, 1]


def test_numa_maps_counts_anonymous_pages_per_node_by_size_not_files(tmp_path):
    got = residence.read_process([2], pid=77, proc=_fake_proc(tmp_path, "numa_maps", NUMA_MAPS))
    # file pages (N0=40 N1=42) left out; 4 huge pages of 2 MiB weigh 4 x 512 small ones.
    assert got.by_node == {0: 256 + 33, 3: 768, 2: 1024, 1: 4 * 512}, got.by_node
    assert got.source is residence.ResidenceSource.NUMA_MAPS
    assert got.share_pct == pytest.approx(100 * 1024 / got.resident)
    assert list(got.elsewhere()) == [1, 3, 0]  # most first
    entries = _procfs.parse_numa_maps(NUMA_MAPS)
    assert entries[2].policy == "bind:2-3" and entries[1].kind == "heap" and entries[0].file == "/usr/bin/python3"
    with pytest.raises(ValueError):
        _procfs.parse_numa_maps(b"zzz default N0=1\n")


def test_spread_is_even_inside_the_ranges_and_asks_each_page_once_when_few():
    ranges = [(0, 40 * 4096), (1 << 30, (1 << 30) + 60 * 4096)]
    few = residence.spread(ranges, 1000)
    assert len(few) == 100 and len(set(few)) == 100
    got = residence.spread(ranges, 10)
    assert len(got) == 10 and sum(a < (1 << 30) for a in got) == 4  # 40% of the pages, 40% of the asks
    assert all(a % 4096 == 0 for a in got)
    assert all(lo <= a < hi for a in got for lo, hi in [next(r for r in ranges if r[0] <= a < r[1])])


def test_no_planned_node_reports_pages_by_node_and_judges_nothing():
    r = residence.Residence("process", (), {0: 5, 1: 5})
    assert r.share_pct is None and residence.below(r, 99.0) is None and "no node planned" not in r.describe()
    assert residence.planned_nodes("none", [0]) == () and residence.planned_nodes("interleave", [1, 0]) == (0, 1)


def test_a_look_comes_back_from_its_event_dict():
    """What an event or the self-test job's evidence holds is the Residence it was (JSON keys are text)."""
    r = residence.Residence("pinned batch buffers", (0, 2), {0: 30, 1: 60, 2: 10}, residence.ResidenceSource.NUMA_MAPS,
                            100, 4, 12.5)
    back = residence.Residence.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.elsewhere() == {1: 60.0} and back.describe() == r.describe()
    with pytest.raises(KeyError):
        residence.Residence.from_dict({"what": "process"})


# ---- the periodic watch -------------------------------------------------------------------
class _Events:
    def __init__(self):
        self.items = []

    def event(self, kind, **fields):
        self.items.append((kind, fields))

    def flush(self):
        pass


def test_the_watch_looks_at_its_rate_warns_once_naming_the_node_and_says_when_it_is_back(tmp_path):
    import torch

    now = [0.0]
    answer = [1]  # every page on node 1 at first: planned node 0
    ev = _Events()
    batch = [torch.ones(1 << 20, dtype=torch.uint8)]
    w = ResidenceWatch([0], 60.0, 90.0, ev, 3, lambda: batch, clock=lambda: now[0],
                       query=lambda addrs: [answer[0]] * len(addrs))
    assert not w.tick()  # the first look comes FIRST_LOOK_S in
    now[0] = 10.0
    assert w.tick()
    looks = ev.items[0][1]["looks"]
    assert [x["what"] for x in looks] == ["process", "batch buffers"] and looks[0]["share_pct"] == 0.0
    warnings = [f for k, f in ev.items if k == "warning"]
    assert len(warnings) == 2 and all("100.0% on node 1" in f["message"] and f["message"].startswith("rank 3:")
                                      for f in warnings), warnings
    now[0] = 30.0
    assert not w.tick()  # 60 s between looks
    now[0] = 70.0
    assert w.tick() and len([k for k, _ in ev.items if k == "warning"]) == 2  # said once while it lasts
    answer[0] = 0
    now[0] = 131.0
    assert w.tick()
    back = [f["message"] for k, f in ev.items if k == "residence" and "message" in f]
    assert len(back) == 2 and "back to 100.0%" in back[0], back


@needs_move_pages
@pytest.mark.slow
def test_a_bound_rank_logs_residence_of_its_pages_and_its_dataloaders_buffers(tmp_path):
    pytest.importorskip("numa")
    code = textwrap.dedent(f"""
        import time, torch, placement
        data = torch.utils.data.TensorDataset(torch.randn(4096, 64))
        loader = torch.utils.data.DataLoader(data, batch_size=256, num_workers=0, pin_memory=False)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        h = placement.attach(model, opt, policy="node", memory="bind", tune={{"enabled": False}},
                             monitor={{"log_dir": {str(tmp_path)!r}, "summary_every": 0, "residence_every_s": 1}})
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            for (x,) in h.watch(loader):
                model(x).sum().backward(); opt.step(); opt.zero_grad()
                time.sleep(0.01)
        h.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    memory = next(e for e in events if e["type"] == "memory")
    assert memory["resident"]["asked"] > 0, memory
    looks = [x for e in events if e["type"] == "residence" for x in e["looks"]]
    whats = {x["what"] for x in looks}
    assert {"process", "batch buffers"} <= whats, looks
    assert all(x["planned"] == memory["planned"]["nodes"] for x in looks)
    if len(ONLINE) == 1:
        assert all(x["share_pct"] == 100.0 for x in looks), looks
        assert not [e for e in events if e["type"] == "warning" and "residence" in e.get("message", "")]
