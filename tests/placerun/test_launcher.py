"""placerun's argument handling against torch's own torchrun parser and config_from_args; bad
input ends before any worker with one line and exit 2. No workers are started here."""
import os
import sys

import pytest
from torch.distributed import run as torchrun

from placement import launcher
from placement.config import PlacementConfig
from placement.handoff import PLAN_FILE_ENV, Handoff
from placement.launcher import main, make_handoff, parse_placerun_args, worker_launch
from placement.plan.model import Plan

TORCH_FLAGS = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               "127.0.0.1:29999", "--rdzv-id", "job7", "--max-restarts", "3", "--monitor-interval", "0.5",
               "--log-dir", "/tmp/elastic", "--redirects", "3", "--tee", "1", "--role", "trainer",
               "--local-ranks-filter", "0"]


def test_torch_flags_parse_exactly_as_torchrun_parses_them():
    pa = parse_placerun_args([*TORCH_FLAGS, "placement.policy=exclusive", "train.py", "--epochs", "2"])
    assert vars(pa.torch_args) == vars(torchrun.parse_args([*TORCH_FLAGS, "train.py", "--epochs", "2"]))
    assert pa.overrides == ["placement.policy=exclusive"] and pa.config_file is None and not pa.dry_run


def test_placement_args_may_sit_anywhere_before_the_script_and_script_args_are_untouched():
    argv = ["--standalone", "placement.memory=preferred", "--nproc_per_node=2", "--placement-config", "p.yaml",
            "+placement.smt=use", "--dry-run", "-m", "pkg.train", "placement.policy=node", "--dry-run"]
    pa = parse_placerun_args(argv)
    assert pa.overrides == ["placement.memory=preferred", "+placement.smt=use"]
    assert pa.config_file == "p.yaml" and pa.dry_run
    t = pa.torch_args
    assert t.standalone and t.nproc_per_node == "2" and t.module
    assert t.training_script == "pkg.train"
    assert t.training_script_args == ["placement.policy=node", "--dry-run"]  # the script's own
    assert not hasattr(t, "placement_config") and not hasattr(t, "placement_dry_run")


HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(launcher.__file__)), "_worker_hook")


@pytest.mark.parametrize("flags", [[], ["-m"]])
def test_python_workers_run_torchruns_own_command_with_the_startup_hook(flags):
    """What torch's own config_from_args makes of the args: the very command torchrun runs."""
    pa = parse_placerun_args(["--nproc-per-node", "1", *flags, "train.py", "--x", "1"])
    launch = worker_launch(pa.torch_args, environ={"PYTHONPATH": "/mine"})
    assert torchrun.config_from_args(launch.torch_args)[1:] == torchrun.config_from_args(pa.torch_args)[1:]
    assert launch.environ == {"PYTHONPATH": HOOK_DIR + os.pathsep + "/mine", "PLACEMENT_USER_PYTHONPATH": "/mine"}
    assert worker_launch(pa.torch_args, environ={}).environ == {"PYTHONPATH": HOOK_DIR}
    assert launch.program == ""  # torch names the user's program itself


def test_no_python_binds_then_execs_under_placeruns_own_interpreter(monkeypatch):
    monkeypatch.setenv("PYTHON_EXEC", "/other/python")  # not used by torch for --no-python, nor by us
    pa = parse_placerun_args(["--nproc-per-node", "1", "--no-python", "prog.sh", "--x"])
    launch = worker_launch(pa.torch_args)
    _, cmd, cmd_args = torchrun.config_from_args(launch.torch_args)
    assert cmd == sys.executable and cmd_args == ["-u", "-m", "placement.bootstrap", "--no-python", "prog.sh", "--x"]
    assert launch.program == "prog.sh" and "PYTHONPATH" not in launch.environ
    assert pa.torch_args.training_script == "prog.sh"  # the parsed args are not modified


def test_run_path_stays_in_process_through_bootstrap():
    import placement.bootstrap

    pa = parse_placerun_args(["--nproc-per-node", "1", "--run-path", "/abs/train.py", "--x"])
    _, cmd, cmd_args = torchrun.config_from_args(worker_launch(pa.torch_args).torch_args)
    assert cmd is torchrun.run_script_path
    assert cmd_args == [os.path.abspath(placement.bootstrap.__file__), "--run-path", "/abs/train.py", "--x"]


def test_virtual_local_rank_hands_over_the_launchers_device_list():
    pa = parse_placerun_args(["--nproc-per-node", "2", "--virtual-local-rank", "t.py"])
    cfg, plan = PlacementConfig(), Plan("none", [])
    assert make_handoff(cfg, plan, pa.torch_args, environ={"CUDA_VISIBLE_DEVICES": "3,5"}).to_dict()[
        "virtual_local_rank"] == {"devices": ["3", "5"]}
    assert make_handoff(cfg, plan, pa.torch_args, environ={}).to_dict()["virtual_local_rank"] == {"devices": None}


def test_the_rest_of_torch_distributed_run_is_reachable_here():
    assert launcher.parse_min_max_nnodes("2:20") == (2, 20)
    with pytest.raises(AttributeError):
        launcher.no_such_thing


def one_line_exit_2(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("placerun: "), err
    for n in needles:
        assert n in err, err


def test_unknown_override_key(capsys):
    one_line_exit_2(capsys, ["--nproc-per-node", "2", "placement.polcy=node", "t.py"],
                    "placement.polcy", "placement.policy")


def test_bad_override_value_lists_choices(capsys):
    one_line_exit_2(capsys, ["placement.policy=fastest", "t.py"], "'fastest'", "auto, node, socket, exclusive")


def test_override_without_prefix(capsys):
    one_line_exit_2(capsys, ["--nproc-per-node", "2", "policy=node", "t.py"], "placement.policy=node")


def test_unreadable_config_file(capsys, tmp_path):
    one_line_exit_2(capsys, ["--placement-config", str(tmp_path / "missing.yaml"), "t.py"], "missing.yaml")


@pytest.mark.parametrize("argv", [["--no-python", "-m", "t"], ["--nproc-per-node", "lots", "t.py"],
                                  ["--logs-specs", "NO_SUCH_SPECS", "t.py"]])
def test_torchs_own_errors_stay_torchs(argv, capsys):
    """torchrun raises ValueError from main() for these (exit 1 from the console script)."""
    with pytest.raises(ValueError) as torch_error:
        torchrun.main(argv)
    with pytest.raises(ValueError) as ours:
        main(argv)
    assert str(ours.value) == str(torch_error.value)


def test_torchrun_flag_errors_are_argparse_errors_as_with_torchrun(capsys):
    with pytest.raises(SystemExit) as e:
        parse_placerun_args(["--no-such-flag", "t.py"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        parse_placerun_args(["placement.policy=node"])  # an override but no script
    assert e.value.code == 2


@pytest.mark.parametrize("argv, needles", [
    (["--nproc-per-node", "2", "placement.reserved_cpus=0-4095", "placement.strict=true", "t.py"],
     ["reserved_cpus", "no usable CPU"]),
    (["--nproc-per-node", str(4 * os.cpu_count() + 1), "placement.strict=true", "t.py"],
     ["nproc_per_node", "strict=false"]),
])
def test_plan_shortfall_is_one_line_before_any_worker(capsys, argv, needles):
    one_line_exit_2(capsys, argv, *needles)


def test_dry_run_prints_exactly_what_placement_plan_prints(capsys):
    from placement.cli import main as placement_main

    assert main(["--standalone", "--nproc-per-node", "2", "placement.memory=preferred", "--dry-run",
                 "train.py", "--lr", "1"]) == 0
    dry = capsys.readouterr().out
    assert placement_main(["plan", "--nproc-per-node", "2", "placement.memory=preferred"]) == 0
    table = capsys.readouterr().out
    assert dry.startswith(table) and "preferred" in table
    assert dry[len(table):].strip().endswith(f"{sys.executable} -u train.py --lr 1")  # torchrun's own command


def test_a_shortfall_runs_degraded_by_default_and_the_banner_says_so_in_one_line(capsys):
    from placement.config import load_config
    from placement.launcher import concise_plan
    from placement.plan import plan_for_node

    n = 4 * os.cpu_count() + 1
    assert main(["--nproc-per-node", str(n), "--dry-run", "t.py"]) == 0
    assert "warning" in capsys.readouterr().out
    _, plan = plan_for_node(load_config([]), n)
    banner = concise_plan(plan).splitlines()
    warnings = [line for line in banner if "warning" in line]
    assert len(plan.warnings) > 1 and len(warnings) == 1 and f"nproc_per_node={n}" in warnings[0]


@pytest.mark.parametrize("overrides,torch_binds,plan_policy,words", [
    ([], False, "auto within node", "--numa-binding=node: placement binds each rank inside the CPU set torch's node"),
    (["placement.policy=auto"], False, "auto within node", "with its thread roles placed within"),
    (["placement.policy=none"], True, "none", "with placement.policy=none: torch binds the workers"),
    (["placement.policy=node"], False, "node", "placement.policy=node agrees with --numa-binding=node"),
    (["placement.policy=socket"], False, "socket", "placement.policy=socket wins over --numa-binding=node"),
])
def test_torch_numa_binding_runs_and_one_line_says_who_binds(monkeypatch, capsys, tmp_path, overrides, torch_binds,
                                                             plan_policy, words):
    """torchrun runs `--numa-binding node`, so placerun does: never exit 2. Where placement binds,
    torch's own binding (a numactl wrapper) is taken out of torch's args and the plan is the one
    handed to the workers; with policy none torch keeps its flag."""
    started = []

    def record(launch):
        started.append((launch.torch_args.numa_binding, Handoff.read(os.environ[PLAN_FILE_ENV]).plan))

    monkeypatch.setattr(launcher, "_run", record)
    argv = ["--standalone", "--nproc-per-node", "2", "--numa-binding", "node", *overrides,
            f"placement.monitor.log_dir={tmp_path}", "t.py"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "--numa-binding" in line]
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("placerun: "), err
    ((numa_binding, plan),) = started
    assert numa_binding == ("node" if torch_binds else None)
    assert plan.policy == plan_policy
