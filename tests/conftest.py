"""Shared test hygiene: no launcher a test started outlives it, pass or fail."""
import pytest

from placerun_helpers import reap_started


@pytest.fixture(autouse=True)
def _reap_launchers():
    yield
    reap_started()
