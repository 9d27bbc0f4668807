"""The two kernel text forms of CPU sets round-trip, and sysfs quirks are tolerated."""
import pytest
from hypothesis import given, strategies as st

from placement.cpuset import format_cpulist, format_cpumask, parse_cpulist, parse_cpumask


def test_list_forms():
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("0-7:2") == {0, 2, 4, 6}
    assert parse_cpulist("0-1\x00\n") == {0, 1}
    assert parse_cpulist("") == frozenset()
    assert format_cpulist({0, 1, 2, 3, 8}) == "0-3,8"


def test_mask_forms():
    assert parse_cpumask("00000000,0000000f") == {0, 1, 2, 3}
    assert parse_cpumask("1,00000000\x00") == {32}
    assert format_cpumask({0, 33}) == "00000002,00000001"


@pytest.mark.parametrize("bad", ["a-b", "3-1", "-1", "0-3:0"])
def test_bad_lists_raise(bad):
    with pytest.raises(ValueError):
        parse_cpulist(bad)


@given(st.frozensets(st.integers(0, 4095), max_size=64))
def test_round_trips(cpus):
    assert parse_cpulist(format_cpulist(cpus)) == cpus
    assert parse_cpumask(format_cpumask(cpus)) == cpus
