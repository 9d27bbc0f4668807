"""Span readings of the threads read once per span (`other`, `dataloader`): a full span reads
every counter, a light one (a tuner's window between full spans) only their schedstat, and
both agree with what the kernel says the threads spent."""
import os
import threading

from placement.monitor.probes.threads import RoleSampler
from placement.monitor.warn import WarnOnce
from placement.roles import ThreadInfo, ThreadRole


class Burster:
    """A thread that spins for `n` loops when asked, then blocks: idle while it is read, so
    the sampler's reading and the test's read of /proc see the same counters."""

    def __init__(self):
        self.go, self.done, self.quit = threading.Event(), threading.Event(), False
        self.n = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.done.wait(10)
        self.tid = self.thread.native_id

    def _run(self):
        self.done.set()
        while True:
            self.go.wait()
            self.go.clear()
            if self.quit:
                return
            sum(range(self.n))
            self.done.set()

    def burst(self, n: int) -> None:
        self.done.clear()
        self.n = n
        self.go.set()
        assert self.done.wait(30)

    def schedstat_ns(self) -> tuple[int, int]:
        with open(f"/proc/self/task/{self.tid}/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run), int(wait)

    def stop(self):
        self.quit = True
        self.go.set()
        self.thread.join(10)


def test_a_light_span_has_the_times_a_full_one_every_counter_both_as_the_kernel_counts():
    b = Burster()
    try:
        sampler = RoleSampler(lambda: [ThreadInfo(os.getpid(), b.tid, "burster", ThreadRole.OTHER)], WarnOnce())
        sampler.read_span(1, 1)  # the baseline
        before = b.schedstat_ns()
        b.burst(2_000_000)
        light = sampler.read_span(10, None)
        mid = b.schedstat_ns()
        # the light span: other's on-CPU and runqueue time per step, nothing of main, no faults
        assert set(light) == {ThreadRole.OTHER}
        other = light[ThreadRole.OTHER]
        assert other.threads == 1 and other.span_steps == 10
        assert abs(other.cpu_ms * 10 - (mid[0] - before[0]) / 1e6) < 0.01
        assert abs(other.runq_ms * 10 - (mid[1] - before[1]) / 1e6) < 0.01
        assert other.minflt is None and other.nivcsw is None and other.migrations is None
        b.burst(1_000_000)
        full = sampler.read_span(5, 15)
        after = b.schedstat_ns()
        # the full span: the times since the light one, every other counter since the full one
        other = full[ThreadRole.OTHER]
        assert abs(other.cpu_ms * 5 - (after[0] - mid[0]) / 1e6) < 0.01
        assert other.minflt is not None and other.nivcsw is not None and other.migrations is not None
        assert full[ThreadRole.MAIN].minflt is not None and full[ThreadRole.MAIN].nivcsw is not None
        sampler.close()
    finally:
        b.stop()
