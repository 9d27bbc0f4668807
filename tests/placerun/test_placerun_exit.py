"""Exit codes and signals: placerun gives what real torchrun gives on the same job, side by side;
bad input ends with one line and exit 2 before any worker starts."""
import os
import signal
import textwrap

import pytest

from placerun_helpers import launcher, start, text, wait_for

pytestmark = pytest.mark.slow

JOB = textwrap.dedent("""
    import os, sys, time
    open(sys.argv[1] + "." + os.environ["LOCAL_RANK"], "w").close()
    if sys.argv[2] == "sleep":
        time.sleep(120)
    sys.exit(int(sys.argv[2]))
""")


def both(tmp_path, job_arg, flags=("--standalone", "--nproc-per-node", "2")):
    """Start the same job under placerun and torchrun at once; returns {name: (proc, log prefix, marker)}."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    runs = {}
    for name in ("placerun", "torchrun"):
        marker = tmp_path / f"{name}.started"
        prefix = tmp_path / name
        runs[name] = (start([*launcher(name), *flags, str(script), str(marker), job_arg], prefix), prefix, marker)
    return runs


@pytest.mark.parametrize("job_exit, launcher_exit", [("3", 1)])  # success (0, 0): the elastic test
def test_worker_exit_codes_match_torchrun(tmp_path, job_exit, launcher_exit):
    runs = both(tmp_path, job_exit)
    codes = {name: p.wait(timeout=180) for name, (p, _, _) in runs.items()}
    assert codes == {"placerun": launcher_exit, "torchrun": launcher_exit}, text(runs["placerun"][1], "err")[-3000:]
    if launcher_exit:
        for name, (_, prefix, _) in runs.items():
            assert "ChildFailedError" in text(prefix, "err") and "exitcode  : 3" in text(prefix, "err")


def test_sigterm_to_the_agent_matches_torchrun(tmp_path):
    runs = both(tmp_path, "sleep", flags=("--standalone", "--nproc-per-node", "1"))
    wait_for([f"{m}.0" for _, _, m in runs.values()], [(p, prefix) for p, prefix, _ in runs.values()])
    for p, _, _ in runs.values():
        os.kill(p.pid, signal.SIGTERM)
    codes = {name: p.wait(timeout=120) for name, (p, _, _) in runs.items()}
    assert codes["placerun"] == codes["torchrun"] == 1
    for _, prefix, _ in runs.values():
        assert "SignalException" in text(prefix, "err")


def test_bad_input_stops_before_any_worker(tmp_path):
    """(Each kind of bad input is in test_launcher.py; this is the installed command, end to end.)"""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    marker = tmp_path / "started"
    p = start([*launcher("placerun"), "--standalone", "--nproc-per-node", "2", "placement.reserved_cpus=0-4095",
               "placement.strict=true",
               str(script), str(marker), "0"],
              tmp_path / "placerun")
    assert p.wait(timeout=120) == 2
    err = text(tmp_path / "placerun", "err")
    assert err.count("\n") == 1 and err.startswith("placerun: ") and "reserved" in err, err
    assert not list(tmp_path.glob("started*"))
