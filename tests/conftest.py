"""Shared test hygiene: no launcher a test started outlives it, pass or fail; a one-rank gloo
world for tests that attach to a real process group."""

import pytest
import torch.distributed as dist

from hostbed import hostbed_factory
from placerun_helpers import free_port, reap_started


@pytest.fixture(autouse=True)
def _reap_launchers():
    yield
    reap_started()


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def hostbed(request):
    """make(n, machine_roots=None) -> HostBed: n hosts with their own network and hostname
    (tests/hostbed.py), torn down when the test ends, pass or fail; skips where namespaces are
    not allowed."""
    return hostbed_factory(request)
