"""ThreadScan: the span's look at the rank's threads. The full list (the binder's rescan, or
scan_threads) is read again only when the thread count or the main thread's children changed,
once more after that (a new thread names itself just after it starts), and at every
FULL_EVERY-th look; a look is two preads. Run on a /proc tree whose two files the test rewrites
in place (the scan keeps them open, as it keeps the real ones)."""
import os

from placement.monitor.probes.threads import ThreadScan


def write_proc(root, threads: int, children: list[int]) -> None:
    """This process's real stat line with its thread count (field 20) set, and its main
    thread's children file."""
    pid = os.getpid()
    with open(f"/proc/{pid}/stat", "rb") as f:
        real = f.read()
    close = real.rfind(b")")
    fields = real[close + 2:].split()
    fields[17] = str(threads).encode()
    task = root / str(pid) / "task" / str(pid)
    task.mkdir(parents=True, exist_ok=True)
    (root / str(pid) / "stat").write_bytes(real[:close + 2] + b" ".join(fields) + b"\n")
    (task / "children").write_bytes("".join(f"{c} " for c in children).encode())


def test_the_full_list_is_read_again_only_when_threads_or_children_change(tmp_path):
    assert ThreadScan.FULL_EVERY == 8  # the look numbers below are laid out around it
    write_proc(tmp_path, threads=5, children=[])
    full_reads = []
    scan = ThreadScan(lambda: full_reads.append(1) or [], proc=str(tmp_path))

    def looks(n: int) -> int:
        before = len(full_reads)
        for _ in range(n):
            scan()
        return len(full_reads) - before

    try:
        assert looks(2) == 2  # looks 1-2: the first, and one more while it settles
        assert looks(2) == 0  # 3-4: nothing changed
        write_proc(tmp_path, threads=6, children=[])  # a new thread
        assert looks(2) == 2  # 5-6: it, and its name once set
        assert looks(1) == 0  # 7
        assert looks(1) == 1  # 8: every FULL_EVERY-th look (a thread that replaced another)
        assert looks(2) == 0  # 9-10
        write_proc(tmp_path, threads=6, children=[4242])  # a DataLoader worker forked by main
        assert looks(2) == 2  # 11-12
        assert looks(3) == 0  # 13-15
    finally:
        scan.close()
