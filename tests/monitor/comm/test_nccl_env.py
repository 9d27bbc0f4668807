"""placement.monitor.nccl_timing: what placement sets for NCCL collective timing and the
flight recorder's ring, and that a user's own setting always wins."""
from __future__ import annotations

import pytest

from placement.bind.nccl_env import (PLACEMENT_RING, NcclTimingMode, decide_nccl_env,
                                        timing_enabled_by_env)


def test_auto_turns_timing_on_and_asks_for_a_ring_that_holds_a_tp_step():
    d = decide_nccl_env(NcclTimingMode.AUTO, {})
    assert d.env == {"TORCH_NCCL_ENABLE_TIMING": "1", "TORCH_FR_BUFFER_SIZE": str(PLACEMENT_RING)}
    assert d.timing_on and d.note is None


def test_auto_leaves_timing_off_where_it_would_break_overlap():
    d = decide_nccl_env(NcclTimingMode.AUTO, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert "TORCH_NCCL_ENABLE_TIMING" not in d.env and not d.timing_on
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in d.note and "143890" in d.note
    forced = decide_nccl_env(NcclTimingMode.ON, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert forced.env["TORCH_NCCL_ENABLE_TIMING"] == "1" and forced.timing_on


@pytest.mark.parametrize("env,on", [({"TORCH_NCCL_ENABLE_TIMING": "0"}, False),
                                    ({"NCCL_ENABLE_TIMING": "1"}, True),
                                    ({"TORCH_NCCL_ENABLE_TIMING": "0", "TORCH_NCCL_DESYNC_DEBUG": "1"}, True)])
def test_a_users_timing_setting_wins(env, on):
    for mode in NcclTimingMode:
        d = decide_nccl_env(mode, env)
        assert "TORCH_NCCL_ENABLE_TIMING" not in d.env and d.timing_on is on


def test_debug_detail_forces_timing_as_processgroupnccl_does():
    assert timing_enabled_by_env({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert not timing_enabled_by_env({"TORCH_DISTRIBUTED_DEBUG": "INFO"})
    d = decide_nccl_env(NcclTimingMode.OFF, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert d.timing_on and "TORCH_NCCL_ENABLE_TIMING" not in d.env


def test_a_users_ring_wins_and_off_sets_no_timing():
    d = decide_nccl_env(NcclTimingMode.OFF, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"})
    assert d.env == {} and not d.timing_on and "nccl_timing=off" in d.note


def test_after_init_process_group_nothing_is_set_and_one_line_says_what_to_do():
    d = decide_nccl_env(NcclTimingMode.AUTO, {}, process_group_exists=True)
    assert d.env == {} and not d.timing_on and "before it" in d.note


def test_stage1_sets_it_unless_the_user_did(monkeypatch):
    from placement.bind.stage1 import apply_nccl_timing_env
    from placement.config import load_config

    environ, env_set = {}, {}
    assert apply_nccl_timing_env(load_config([]), environ, env_set, (), "placerun") is None
    assert environ["TORCH_NCCL_ENABLE_TIMING"] == "1" and env_set == environ
    environ = {"TORCH_NCCL_ENABLE_TIMING": "0"}
    note = apply_nccl_timing_env(load_config(["monitor.nccl_timing=on"]), environ, {}, (), "placerun")
    assert environ["TORCH_NCCL_ENABLE_TIMING"] == "0" and "set off by the user" in note


# What c10d's getCvarBool (Utils.hpp:151-189, torch 2.11.0 and 2.13) makes of these: the first
# variable of a list that is set wins; the value is lower-cased, not stripped; "t" is a yes.
@pytest.mark.parametrize("env,on", [({"TORCH_NCCL_ENABLE_TIMING": "t"}, True),
                                    ({"TORCH_NCCL_ENABLE_TIMING": "True"}, True),
                                    ({"TORCH_NCCL_ENABLE_TIMING": "0", "NCCL_ENABLE_TIMING": "1"}, False),
                                    ({"TORCH_NCCL_ENABLE_TIMING": "1", "NCCL_ENABLE_TIMING": "0"}, True),
                                    ({"TORCH_NCCL_DESYNC_DEBUG": "n", "NCCL_DESYNC_DEBUG": "y"}, False),
                                    ({"TORCH_NCCL_ENABLE_TIMING": "on"}, False),
                                    ({"TORCH_NCCL_ENABLE_TIMING": " 1"}, False),
                                    ({"TORCH_NCCL_ENABLE_TIMING": "1", "TORCH_NCCL_DESYNC_DEBUG": "maybe"}, False)])
def test_timing_variables_read_as_c10d_reads_them(env, on):
    assert timing_enabled_by_env(env) is on


def test_a_value_torch_refuses_is_left_alone_and_named():
    for mode in NcclTimingMode:
        d = decide_nccl_env(mode, {"TORCH_NCCL_ENABLE_TIMING": "on"})
        assert "TORCH_NCCL_ENABLE_TIMING" not in d.env and not d.timing_on
        assert "TORCH_NCCL_ENABLE_TIMING='on'" in d.note and "refuses" in d.note


# One torch import; each word in a forked child (the recorder singleton reads its variables once).
_GETCVARBOOL_PROBE = r"""
import json, os, sys
import torch._C._distributed_c10d as c10d
out = {}
for word in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        os.environ["TORCH_FR_CPP_STACK"] = word
        try:
            c10d._dump_fr_trace_json()
        except RuntimeError as e:
            os._exit(3 if "Invalid value for environment variable" in str(e) else 4)
        os._exit(0)
    out[word] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_words_c10d_refuses_are_the_ones_real_torch_refuses():
    """Real torch's getCvarBool, reached through the generic flight recorder's constructor
    (FlightRecorder.hpp:112, TORCH_FR_CPP_STACK, read by the same function as
    TORCH_NCCL_ENABLE_TIMING), refuses exactly the words cvar_bool refuses."""
    import json
    import subprocess
    import sys

    from placement.bind.nccl_env import cvar_bool

    words = ["1", "0", "t", "F", "y", "No", "yes", "TRUE", "false", "on", "off", " 1", "1 ", "2", ""]
    done = subprocess.run([sys.executable, "-c", _GETCVARBOOL_PROBE, json.dumps(words)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    torch_says = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(torch_says.values()) <= {0, 3}, torch_says  # refused for its value, or read
    for word in words:
        try:
            cvar_bool({"TORCH_FR_CPP_STACK": word}, ("TORCH_FR_CPP_STACK",))
            ours = 0
        except ValueError:
            ours = 3
        assert ours == torch_says[word], (word, torch_says)
