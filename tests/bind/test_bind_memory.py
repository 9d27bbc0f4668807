"""Memory policy: applied through libnuma, verified with get_mempolicy, stepped down when refused.

Refusal is real: a child process installs a seccomp filter that answers set_mempolicy with
EPERM, which is what Docker's default profile does without CAP_SYS_NICE.
"""
import json
import os
import platform
import subprocess
import sys
import textwrap
import threading

import pytest

from placement.bind import apply_memory_policy, read_mempolicy
from placement.events import EventLog
from placement.plan.model import MemoryPolicy

numa = pytest.importorskip("numa", reason="py-libnuma (libnuma) is needed to apply memory policies")

NODE = sorted(numa.memory.get_allocation_allowed_nodes())[0]
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}.get(platform.machine())


def in_thread(fn):
    """Memory policy is per thread: run `fn` in a fresh thread so the test process keeps its own."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def libnuma_view():
    """What libnuma itself reports for the calling thread (an independent read-back)."""
    return {"membind": sorted(numa.memory.get_membind_nodes()), "preferred": numa.LIBNUMA.numa_preferred(),
            "interleave": sorted(numa.memory.get_interleave_nodes())}


@pytest.mark.parametrize("mode", ["bind", "preferred", "interleave"])
def test_each_mode_is_applied_and_verified(mode, tmp_path):
    events = EventLog(str(tmp_path / "rank0.jsonl"))

    def run():
        return apply_memory_policy(MemoryPolicy(mode, [NODE]), events), read_mempolicy(), libnuma_view()

    applied, kernel, libnuma = in_thread(run)
    events.close()
    assert applied.verified and applied.fallback is None
    assert applied.applied == MemoryPolicy(mode, [NODE]) == kernel
    if mode == "bind":
        assert libnuma["membind"] == [NODE]
    elif mode == "preferred":
        assert libnuma["preferred"] == NODE
    else:
        assert libnuma["interleave"] == [NODE]
    (event,) = [json.loads(line) for line in open(tmp_path / "rank0.jsonl")]
    assert event["type"] == "memory" and event["applied"] == {"mode": mode, "nodes": [NODE]}
    assert event["planned"] == event["applied"] and event["fallback"] is None


def test_none_leaves_the_default_policy():
    applied = in_thread(lambda: apply_memory_policy(MemoryPolicy("none", [])))
    assert applied.applied.mode == "none" and applied.fallback is None and applied.verified


def test_a_node_that_does_not_exist_steps_down_and_says_why():
    bad = max(numa.memory.get_allocation_allowed_nodes()) + 100
    applied = in_thread(lambda: apply_memory_policy(MemoryPolicy("bind", [bad])))
    assert applied.applied.mode == "none"
    assert f"bind [{bad}] refused: EINVAL" in applied.fallback
    assert "left as it was" in applied.fallback


def test_calling_thread_only():
    in_thread(lambda: apply_memory_policy(MemoryPolicy("bind", [NODE])))
    assert read_mempolicy().mode == "none"  # this thread never asked


SECCOMP_CHILD = textwrap.dedent("""
    import ctypes, json, struct, sys
    nr, mode, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

    # seccomp BPF: set_mempolicy (of `mode`, or any when mode < 0) -> EPERM, all else allowed
    ld_nr, ld_arg0, ret_eperm, ret_allow = (0x20, 0, 0, 0), (0x20, 0, 0, 16), (0x06, 0, 0, 0x50001), (0x06, 0, 0, 0x7fff0000)
    if mode < 0:
        prog = [ld_nr, (0x15, 0, 1, nr), ret_eperm, ret_allow]
    else:
        prog = [ld_nr, (0x15, 0, 3, nr), ld_arg0, (0x15, 0, 1, mode), ret_eperm, ret_allow]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Fprog(len(prog), ctypes.addressof(buf))), 0, 0) == 0, ctypes.get_errno()

    from placement.bind import apply_memory_policy, read_mempolicy
    from placement.events import EventLog
    from placement.plan.model import MemoryPolicy
    events = EventLog(log)
    applied = apply_memory_policy(MemoryPolicy("bind", [int(sys.argv[4])]), events)
    events.close()
    kernel = read_mempolicy()
    print(json.dumps({"applied": applied.to_dict(), "kernel": {"mode": kernel.mode, "nodes": kernel.nodes}}))
""")


def run_refused(tmp_path, refuse_mode):
    log = tmp_path / "rank0.jsonl"
    p = subprocess.run([sys.executable, "-c", SECCOMP_CHILD, str(SET_MEMPOLICY), str(refuse_mode), str(log), str(NODE)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    events = [json.loads(line) for line in open(log)]
    return json.loads(p.stdout), events


@pytest.mark.skipif(SET_MEMPOLICY is None, reason=f"no set_mempolicy syscall number known for {platform.machine()}")
def test_container_refusing_bind_steps_down_to_preferred(tmp_path):
    out, events = run_refused(tmp_path, refuse_mode=2)  # MPOL_BIND refused, as seccomp profiles do
    assert out["kernel"] == {"mode": "preferred", "nodes": [NODE]}  # what really holds
    assert out["applied"]["applied"] == out["kernel"] and out["applied"]["verified"]
    assert "EPERM" in out["applied"]["fallback"] and "applied preferred" in out["applied"]["fallback"]
    memory = [e for e in events if e["type"] == "memory"]
    warnings = [e for e in events if e["type"] == "warning"]
    assert memory[0]["planned"] == {"mode": "bind", "nodes": [NODE]}
    assert memory[0]["applied"] == {"mode": "preferred", "nodes": [NODE]}
    assert "EPERM" in warnings[0]["message"]


@pytest.mark.skipif(SET_MEMPOLICY is None, reason=f"no set_mempolicy syscall number known for {platform.machine()}")
def test_container_refusing_every_policy_steps_down_to_none(tmp_path):
    out, events = run_refused(tmp_path, refuse_mode=-1)
    assert out["kernel"] == {"mode": "none", "nodes": []}
    assert out["applied"]["applied"] == out["kernel"]
    assert out["applied"]["fallback"].count("EPERM") == 2  # bind, then preferred, both refused
    assert [e["type"] for e in events] == ["memory", "warning"]


def test_missing_libnuma_is_one_line_and_no_crash(tmp_path):
    """libnuma.so absent: py-libnuma fails at import; here a stand-in package fails the same way."""
    fake = tmp_path / "numa"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise OSError('libnuma.so.1: cannot open shared object file')\n")
    code = ("import placement.bind as b; from placement.plan.model import MemoryPolicy as M; "
            "r = b.apply_memory_policy(M('bind', [0])); print(r.applied.mode); print(r.fallback)")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    mode, reason = p.stdout.strip().splitlines()
    assert mode == "none"
    assert "libnuma.so is not available" in reason and "libnuma.so.1" in reason and "install libnuma1" in reason


def test_missing_py_libnuma_names_the_pip_package():
    """The Python half absent (import numa fails with ImportError): the fix is the pip package."""
    code = ("import sys; sys.modules['numa'] = None; "
            "import placement.bind as b; from placement.plan.model import MemoryPolicy as M; "
            "r = b.apply_memory_policy(M('bind', [0])); print(r.applied.mode); print(r.fallback)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    mode, reason = p.stdout.strip().splitlines()
    assert mode == "none"
    assert "py-libnuma is not installed" in reason and "pip install py-libnuma" in reason
