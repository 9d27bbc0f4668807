"""The backward thread (torch's pt_autograd_<device>, which runs a GPU rank's backward work) is
read on every probe step like main, not once per span like `other`."""
import os
import threading
import time

from placement.monitor.probes.threads import RoleSampler
from placement.monitor.warn import WarnOnce
from placement.roles import ThreadInfo, ThreadRole, role_of


def test_backward_thread_gets_per_step_cpu_and_runqueue_figures():
    stop, ready = threading.Event(), threading.Event()
    tid = []

    def autograd():
        tid.append(threading.get_native_id())
        import torch.multiprocessing

        torch.multiprocessing._set_thread_name("pt_autograd_0")
        ready.set()
        while not stop.is_set():  # busy, as a device thread running backward kernels' launches
            sum(range(2000))

    t = threading.Thread(target=autograd, daemon=True)
    t.start()
    ready.wait()
    try:
        with open(f"/proc/self/task/{tid[0]}/comm") as f:
            name = f.read().strip()
        assert role_of(name) is ThreadRole.BACKWARD
        sampler = RoleSampler(lambda: [ThreadInfo(os.getpid(), tid[0], name, ThreadRole.BACKWARD)], WarnOnce())
        assert sampler.has_hot  # among the every-step probes
        first = sampler.samples(sampler.main.step_read(), sampler.read_hot())
        time.sleep(0.2)
        second = sampler.samples(sampler.main.step_read(), sampler.read_hot())
        assert "backward" in first and "backward" in second
        assert second["backward"].threads == 1 and second["backward"].cpu_ms > 0
        assert second["backward"].runq_ms is not None
        sampler.close()
    finally:
        stop.set()
        t.join()
