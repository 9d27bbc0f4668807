"""Bad input over every entry point: placerun flags and overrides, config files, `placement topo |
plan | doctor | report`, attach(), the Hydra app.

Each case asserts the exit code, one line on stderr naming the value (and the valid choices where
there are choices), no traceback, and no worker started. The CLI entry points are called in
process (`placement.launcher.main`, `placement.cli.main`: the console scripts are these functions),
with placerun's torchrun call replaced by a recorder, so a worker that would start is seen; a
few real console-script and Hydra runs check the same from outside, in parallel.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import placement
from placement import launcher
from placement.cli import main as cli_main
from placement.errors import PlacementError
from placerun_helpers import REPO, launcher as console

CPUS = frozenset(os.sched_getaffinity(0))


# ---- helpers ---------------------------------------------------------------------------------
def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    return lines[0]


@pytest.fixture
def placerun(monkeypatch, capsys, tmp_path):
    """placerun's main in process; returns (exit code, the one stderr line). Fails the test if
    torchrun would have been asked to start workers."""
    started = []
    monkeypatch.setattr(launcher, "_run", lambda args: started.append(args))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "noop.py").write_text("open('worker-ran', 'w').close()\n")

    def run(*argv: str) -> tuple[int, str]:
        rc = launcher.main(["--standalone", "--nproc-per-node", "1", *argv, "noop.py"])
        out = capsys.readouterr()
        assert not started, "a worker was started"
        assert not (tmp_path / "worker-ran").exists()
        return rc, _one_line(out.err)

    return run


@pytest.fixture
def cli(capsys):
    def run(*argv: str) -> tuple[int, str, str]:
        rc = cli_main(list(argv))
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        return rc, out.out, out.err

    return run


def _files(tmp_path: Path) -> dict[str, str]:
    """Bad files of every kind, by name."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "binary.yaml").write_bytes(b"\x00\xff\xfe\x89PNG\r\n\x1a\n" * 20)
    (d / "latin1.yaml").write_bytes(b"policy: caf\xe9\n")
    (d / "list.yaml").write_text("- policy\n- exclusive\n")
    (d / "broken.yaml").write_text("policy: [exclusive\n")
    (d / "number_policy.yaml").write_text("policy: 5\n")
    (d / "scalar_monitor.yaml").write_text("monitor: 3\n")
    (d / "unknown.yaml").write_text("placement:\n  polcy: exclusive\n")
    (d / "nan.yaml").write_text("monitor:\n  budget_pct: .nan\n")
    (d / "number_log_dir.yaml").write_text("monitor:\n  log_dir: 5\n")
    (d / "deep.yaml").write_text("policy: " + "[" * 50000 + "]" * 50000 + "\n")
    (d / "huge.yaml").write_text("# padding\n" * 200000)
    # 309 bytes of YAML aliases: 9^6 shared strings once loaded, a 3.8 MB repr (the error quoted it whole)
    inner = '["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
    for name in "abcdef":
        inner = f"[&{name} {inner}" + f",*{name}" * 8 + "]"
    (d / "alias_bomb.yaml").write_text(f"policy: {inner}\n")
    (d / "hydra_primary.yaml").write_text((REPO / "configs" / "placement" / "default.yaml").read_text())
    (d / "foreign_package.yaml").write_text("# @package db\nhost: x\n")
    os.mkfifo(d / "fifo")
    (d / "zero").symlink_to("/dev/zero")
    (d / "a_file").write_text("x")
    return {p.name: str(p) for p in d.iterdir()} | {"missing": str(d / "missing.yaml"), "dir": str(d)}


@pytest.fixture
def bad(tmp_path):
    return _files(tmp_path)


# ---- placerun: overrides and flags --------------------------------------------------------------
CHOICES_POLICY = "auto, node, socket, exclusive, core-complex, none"
PLACERUN_OVERRIDES = [
    (["placement.policy=fast"], ["'fast'", CHOICES_POLICY]),
    (["placement.memory=fast"], ["'fast'", "bind, preferred, interleave, none"]),
    (["placement.smt=maybe"], ["'maybe'", "avoid, use"]),
    (["placement.monitor.comm_timing=nccl"], ["'nccl'", "auto, wall, flight_recorder, hook, off"]),
    (["placement.tune.rules=[runqueue,bogus]"], ["'bogus'", "runqueue, nccl_core"]),
    (["placement.policy"], ["placement.policy=VALUE", CHOICES_POLICY]),
    (["placement.monitor.flush_every"], ["placement.monitor.flush_every=VALUE", "an integer"]),
    (["placement.bogus=1"], ["placement.bogus", "valid keys: placement.policy"]),
    (["placement.monitor.bogus=1"], ["placement.monitor.bogus", "valid keys"]),
    (["policy=exclusive"], ["'policy=exclusive'", "placement.policy=exclusive"]),
    (["placement.monitor.budget_pct=nan"], ["budget_pct", "nan", "finite"]),
    (["placement.monitor.budget_pct=inf"], ["budget_pct", "inf", "finite"]),
    (["placement.tune.runq_wait_pct=nan"], ["runq_wait_pct", "nan"]),
    (["placement.tune.comm_share_pct=-inf"], ["comm_share_pct", "-inf"]),
    (["placement.monitor.budget_pct=-1"], ["budget_pct=-1.0", "[0.0, 100.0]"]),
    (["placement.tune.data_share_pct=101"], ["data_share_pct=101.0", "[0.0, 100.0]"]),
    (["placement.monitor.flush_every=0"], ["flush_every=0", "[1, 1000000]"]),
    (["placement.monitor.flush_every=abc"], ["'abc'", "an integer"]),
    (["placement.monitor.flush_every=1.5"], ["'1.5'", "an integer"]),
    (["placement.monitor.exchange_every=99999999"], ["exchange_every=99999999", "10000"]),
    (["placement.monitor.enabled=maybe"], ["'maybe'", "true or false"]),
    (["placement.monitor.log_dir="], ["log_dir=''", "a directory path"]),
    (["placement.reserved_cpus=0-99999999999"], ["'0-99999999999'", "8192"]),
    (["placement.reserved_cpus=abc"], ["'abc'", "cpu list"]),
    (["placement.reserved_cpus=5-2"], ["'5-2'", "cpu list"]),
    (["placement.reserved_cpus=0-15:0"], ["'0-15:0'", "cpu list"]),
    (["placement.tune.window=1"], ["window=1", "[2, 10000]"]),
    (["placement.tune.background_nice=20"], ["background_nice=20", "[0, 19]"]),
    (["placement.dataloader_workers=-1"], ["dataloader_workers=-1", "[0, 1024]"]),
    (["placement.dataloader_workers=99999999"], ["dataloader_workers=99999999", "[0, 1024]"]),
    (["placement.strict=sometimes"], ["'sometimes'", "true or false"]),
    (["placement.nccl_topo_file=/nonexistent/topo.xml"], ["/nonexistent/topo.xml"]),
    (["placement.metrics.port=70000"], ["metrics.port=70000", "[0, 65535]"]),
    (["placement.metrics.port=http"], ["'http'", "an integer"]),
    (["placement.metrics.publish_every_s=0"], ["publish_every_s=0.0", "[0.1, 3600.0]"]),
    (["placement.metrics.per_rank=some"], ["'some'", "true or false"]),
    (["placement.metrics.bogus=1"], ["placement.metrics.bogus", "valid keys"]),
    ([f"placement.reserved_cpus=0-{max(CPUS) + 4096}", "placement.strict=true"], ["reserved"]),  # reserves every CPU:
    # refused under strict (the default runs it unbound, monitor only, with one warning line)
]


@pytest.mark.parametrize("argv,needles", PLACERUN_OVERRIDES, ids=[" ".join(a) for a, _ in PLACERUN_OVERRIDES])
def test_placerun_override(placerun, argv, needles):
    rc, line = placerun(*argv)
    assert rc == 2 and line.startswith("placerun: ")
    for n in needles:
        assert n in line, line


def test_placerun_module_named_placement_is_a_module_not_an_override():
    """`-m placement.selftest.job` (what `placement selftest` runs) is a module, as torchrun takes
    it; a setting's name without its value is still one line, with -m or without."""
    from placement.errors import ConfigError
    from placement.launcher import parse_placerun_args

    pa = parse_placerun_args(["--nproc-per-node", "1", "placement.policy=none", "-m", "placement.selftest.job",
                              "--steps", "3"])
    assert (pa.overrides, pa.torch_args.module, pa.torch_args.training_script) == (
        ["placement.policy=none"], True, "placement.selftest.job")
    assert pa.torch_args.training_script_args == ["--steps", "3"]
    for argv in (["-m", "placement.monitor.flush_every", "mod"], ["-m", "placement.monitor", "mod"]):
        with pytest.raises(ConfigError, match="has no value"):
            parse_placerun_args(["--nproc-per-node", "1", *argv])


def test_placerun_unwritable_log_dir(placerun, tmp_path):
    (tmp_path / "file").write_text("x")
    rc, line = placerun(f"placement.monitor.log_dir={tmp_path}/file/logs")
    assert rc == 2 and "not writable" in line and f"{tmp_path}/file/logs" in line


@pytest.mark.parametrize("nproc,needles", [("99999999", ["99999999", "1..8192"]), ("0", ["0", "an integer >= 1"])])
def test_placerun_nproc(monkeypatch, capsys, tmp_path, nproc, needles):
    started = []
    monkeypatch.setattr(launcher, "_run", lambda args: started.append(args))
    monkeypatch.chdir(tmp_path)
    rc = launcher.main(["--standalone", "--nproc-per-node", nproc, "noop.py"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and not started and all(n in line for n in needles), line


CONFIG_FILES = [
    ("binary.yaml", ["binary.yaml", "not UTF-8"]),
    ("latin1.yaml", ["latin1.yaml", "not UTF-8", "byte 11"]),
    ("missing", ["missing.yaml", "No such file"]),
    ("dir", ["bad", "directory"]),
    ("fifo", ["fifo", "FIFO"]),
    ("zero", ["zero", "character device"]),
    ("huge.yaml", ["huge.yaml", "larger than"]),
    ("list.yaml", ["list.yaml", "mapping"]),
    ("broken.yaml", ["broken.yaml", "not valid YAML"]),
    ("number_policy.yaml", ["placement.policy", "5 is not a string"]),
    ("scalar_monitor.yaml", ["placement.monitor", "valid keys"]),
    ("unknown.yaml", ["placement.polcy", "valid keys"]),
    ("nan.yaml", ["budget_pct", "nan", "finite"]),
    ("number_log_dir.yaml", ["placement.monitor.log_dir", "5 is not a string"]),
    ("deep.yaml", ["deep.yaml"]),
    ("alias_bomb.yaml", ["placement.policy", "is not a string"]),
    ("empty_name", ["config file ''", "No such file"]),
    ("hydra_primary.yaml", ["hydra_primary.yaml", "Hydra primary config", "configs/placement.example.yaml"]),
    ("foreign_package.yaml", ["foreign_package.yaml", "package 'db'", "valid: placement"]),
]


@pytest.mark.parametrize("name,needles", CONFIG_FILES, ids=[n for n, _ in CONFIG_FILES])
def test_placerun_config_file(placerun, bad, name, needles):
    rc, line = placerun("--placement-config", bad.get(name, ""))
    assert rc == 2
    if name == "alias_bomb.yaml":  # a value is quoted to ~200 characters, never whole
        assert len(line) < 600, f"{len(line)} characters"
    for n in needles:
        assert n in line, line


# ---- placement topo / plan / doctor ----------------------------------------------------------------
def _xml(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text(body)
    return str(p)


GPU = '<pci busid="{bus}" class="0x030200" link_speed="16 GT/s" link_width="16"/>'


def _xmls(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    good_cpu = '<cpu numaid="0" affinity="{aff}" arch="x86_64">{pci}</cpu>'
    huge = tmp_path / "huge.xml"
    huge.write_text("<system>" + "<!-- pad -->" * (17 * 1024 * 1024 // 12) + "</system>")
    fifo = tmp_path / "fifo.xml"
    os.mkfifo(fifo)
    return {
        "missing": (str(tmp_path / "none.xml"), ["none.xml"]),
        "malformed": (_xml(tmp_path, "malformed.xml", "<system><cpu>"), ["malformed.xml", "malformed XML"]),
        "root": (_xml(tmp_path, "root.xml", "<topology/>"), ["<topology>", "<system>"]),
        "busid": (_xml(tmp_path, "busid.xml", "<system>" + good_cpu.format(aff="ff", pci=GPU.format(bus="zz:not-a-bdf"))
                       + "</system>"), ["'zz:not-a-bdf'", "0000:18:00.0"]),
        "affinity": (_xml(tmp_path, "aff.xml", "<system>" + good_cpu.format(aff="f" * 100000, pci=GPU.format(
            bus="0000:18:00.0")) + "</system>"), ["affinity", "8192"]),
        "bad_affinity": (_xml(tmp_path, "bad_aff.xml", "<system>" + good_cpu.format(aff="xyz", pci="") + "</system>"),
                         ["'xyz'", "hex cpu mask"]),
        "huge": (str(huge), ["huge.xml", "larger than"]),
        "fifo": (str(fifo), ["fifo.xml", "FIFO"]),
        # nested 5,000 deep (under the size cap): a RecursionError out of the walk before
        "deep": (_xml(tmp_path, "deep.xml", "<system>" + good_cpu.format(aff="ff", pci=(
            '<pci busid="0000:17:00.0" class="0x060400">' * 5000 + "</pci>" * 5000)) + "</system>"),
                 ["deep.xml", "nested"]),
    }


@pytest.mark.parametrize("case", ["missing", "malformed", "root", "busid", "affinity", "bad_affinity", "huge", "fifo",
                                  "deep"])
def test_topo_bad_nccl_xml(cli, tmp_path, case):
    path, needles = _xmls(tmp_path)[case]
    rc, out, err = cli("topo", "--nccl-topo-file", path)
    line = _one_line(err)
    assert rc == 2 and line.startswith("placement topo: ") and all(n in line for n in needles), line


@pytest.mark.parametrize("root", ["/nonexistent/tree", "FILE", "EMPTY"])
def test_topo_bad_root(cli, tmp_path, root):
    if root == "FILE":
        (tmp_path / "f").write_text("x")
        root = str(tmp_path / "f")
    elif root == "EMPTY":
        root = str(tmp_path)
    rc, out, err = cli("topo", "--root", root)
    assert rc == 2 and root in _one_line(err)


def test_placerun_bad_nccl_xml_through_an_override(placerun, tmp_path):
    path, needles = _xmls(tmp_path)["busid"]
    rc, line = placerun(f"placement.nccl_topo_file={path}")
    assert rc == 2 and all(n in line for n in needles), line


PLAN_CASES = [
    (["--nproc-per-node", "abc"], ["'abc'", "auto, gpu, cpu"]),
    (["--nproc-per-node", "99999999"], ["99999999", "1..8192"]),
    (["--policy", "fast"], ["'fast'", CHOICES_POLICY]),
    (["placement.reserved_cpus=0-99999999999"], ["'0-99999999999'", "8192"]),
    (["placement.monitor.budget_pct=nan"], ["nan", "finite"]),
]


@pytest.mark.parametrize("argv,needles", PLAN_CASES, ids=[" ".join(a) for a, _ in PLAN_CASES])
def test_plan(cli, argv, needles):
    rc, out, err = cli("plan", *argv)
    line = _one_line(err)
    assert rc == 2 and line.startswith("placement plan: ") and all(n in line for n in needles), line


def test_plan_binary_config(cli, bad):
    rc, out, err = cli("plan", "--placement-config", bad["binary.yaml"])
    assert rc == 2 and "not UTF-8" in _one_line(err)


DOCTOR_CASES = [
    (["--nproc-per-node", "99999999"], ["99999999", "1..8192"]),
    (["--nproc-per-node", "-3"], ["-3", "1..8192"]),
    (["--root", "/nonexistent/tree"], ["/nonexistent/tree"]),
    (["placement.policy=fast"], ["'fast'", CHOICES_POLICY]),
    (["placement.tune.runq_wait_pct=nan"], ["runq_wait_pct", "nan"]),
]


@pytest.mark.parametrize("argv,needles", DOCTOR_CASES, ids=[" ".join(a) for a, _ in DOCTOR_CASES])
def test_doctor(cli, argv, needles):
    rc, out, err = cli("doctor", *argv)
    line = _one_line(err)
    assert rc == 2 and line.startswith("placement doctor: ") and all(n in line for n in needles), line


def test_doctor_bad_nccl_xml(cli, tmp_path):
    path, needles = _xmls(tmp_path)["affinity"]
    rc, out, err = cli("doctor", "--nccl-topo-file", path)
    assert rc == 2 and all(n in _one_line(err) for n in needles)


ARGPARSE_CASES = [
    (["doctor", "--nproc-per-node", "abc"], ["placement doctor", "--nproc-per-node", "'abc'"]),
    (["bogus"], ["'bogus'", "topo", "report"]),
    (["plan", "--bogus"], ["placement", "--bogus"]),
    (["topo", "--root"], ["placement topo", "--root", "expected one argument"]),
    (["report"], ["placement report", "LOG"]),
    (["report", "x.jsonl", "--trace", "t.json", "--steps", "20:10"], ["placement report", "--steps", "'20:10'", "A:B"]),
    (["report", "x.jsonl", "--trace", "t.json", "--steps", "abc"], ["placement report", "--steps", "'abc'", "A:B"]),
    (["report", "x.jsonl", "--trace", "t.json", "--steps", ":"], ["placement report", "--steps", "':'", "A:B"]),
    (["report", "x.jsonl", "--trace", "t.json", "--ranks", "3-1"], ["placement report", "--ranks", "'3-1'", "0-7,64"]),
    (["report", "x.jsonl", "--trace", "t.json", "--ranks", "two"], ["placement report", "--ranks", "'two'", "0-7,64"]),
    (["report", "x.jsonl", "--steps", "1:5"], ["placement report", "--steps", "--trace OUT.json"]),
    (["selftest", "--nproc-per-node", "0"], ["placement selftest", "--nproc-per-node=0"]),
]


@pytest.mark.parametrize("argv,needles", ARGPARSE_CASES, ids=[" ".join(a) for a, _ in ARGPARSE_CASES])
def test_placement_cli_arguments(capsys, argv, needles):
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse's exit, as the console script ends
        rc = e.code
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and all(n in line for n in needles), line


# ---- placement report: unreadable logs are one line; corrupt lines are skipped and counted ----------
STEP = ('{"type":"step","rank":0,"step":%d,"t":%s,"step_ms":10.0,"data_ms":1.0,"comm_ms":2.0,"comm_count":1,'
        '"roles":{"main":{"threads":1,"cpu_ms":5.0,"runq_ms":%s,"cpus":[0]}},"verdict":"balanced"}')
CORRUPT_LINES = {
    "t_not_a_number": STEP % (3, '"abc"', "1.0"),
    "t_null": STEP % (3, "null", "1.0"),
    "runq_is_text": STEP % (3, "1700000003.0", '"lots"'),
    "step_is_text": STEP.replace('"step":%d', '"step":"three"') % ("1700000003.0", "1.0"),
    "stragglers_not_a_list": '{"type":"straggler","rank":0,"t":1700000001.5,"steps":[1,2],"stragglers":"rank 1"}',
    "stragglers_of_numbers": '{"type":"straggler","rank":0,"t":1700000001.5,"steps":[1,2],"stragglers":[1,2]}',
    "event_t_text": '{"type":"warning","rank":0,"t":"soon","message":"x"}',
    "binary": "\udcff\udcfe\x00garbage",
    "json_list": "[1,2,3]",
    "deep_json": "[" * 100000 + "]" * 100000,
}


@pytest.mark.parametrize("kind", list(CORRUPT_LINES))
def test_report_skips_and_counts_a_corrupt_line(cli, tmp_path, kind):
    good = [STEP % (1, "1700000001.0", "1.0"), STEP % (2, "1700000002.0", "1.0")]
    log = tmp_path / "rank0.jsonl"
    log.write_bytes("\n".join(good + [CORRUPT_LINES[kind]]).encode("utf-8", "surrogateescape") + b"\n")
    rc, out, err = cli("report", str(log))
    assert rc == 0 and err == ""
    assert "skipped 1 truncated or corrupt line(s)" in out and "2 step records" in out


@pytest.mark.parametrize("what", ["missing", "empty_dir", "fifo", "zero"])
def test_report_unreadable_log(cli, bad, tmp_path, what):
    path = {"missing": bad["missing"], "fifo": bad["fifo"], "zero": bad["zero"]}.get(what)
    if what == "empty_dir":
        (tmp_path / "empty").mkdir()
        path = str(tmp_path / "empty")
    rc, out, err = cli("report", path)
    line = _one_line(err)
    assert rc == 2 and line.startswith("placement report: ") and os.path.basename(path) in line, line


# ---- attach(): a PlacementError of one line, nothing bound, nothing started -------------------------
def _attach_cases(tmp_path: Path):
    (tmp_path / "file").write_text("x")
    nan = math.nan
    return {
        "policy": ({"policy": "fast"}, {}, ["'fast'", CHOICES_POLICY]),
        "log_dir_number": ({"monitor": {"log_dir": 5}}, {}, ["log_dir", "5 is not a string"]),
        "log_dir_top_level": ({"log_dir": 5}, {}, ["placement.log_dir", "valid keys"]),
        "log_dir_empty": ({"monitor": {"log_dir": ""}}, {}, ["log_dir=''"]),
        "log_dir_unwritable": ({"monitor": {"log_dir": f"{tmp_path}/file/logs"}}, {}, ["not writable", "file/logs"]),
        "budget_nan": ({"monitor": {"budget_pct": nan}}, {}, ["budget_pct", "nan"]),
        "runq_nan": ({"tune": {"runq_wait_pct": nan}}, {}, ["runq_wait_pct", "nan"]),
        "reserved_huge": ({"reserved_cpus": "0-99999999999"}, {}, ["8192"]),
        "local_rank_text": ({"policy": "none"}, {"LOCAL_RANK": "abc"}, ["LOCAL_RANK='abc'", "an integer >= 0"]),
        "local_rank_beyond": ({"policy": "none"}, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK=3", "0..1"]),
        "world_size_negative": ({"policy": "none"}, {"WORLD_SIZE": "-1"}, ["WORLD_SIZE='-1'", ">= 1"]),
        "config_missing": ({"config": f"{tmp_path}/missing.yaml"}, {}, ["missing.yaml"]),
        "config_number": ({"config": 123}, {}, ["attach(config=int)", "PlacementConfig"]),
        "config_no_value": ({"config": ["policy"]}, {}, ["'policy'", "KEY=VALUE"]),
        "config_binary": ({"config": "BINARY"}, {}, ["not UTF-8"]),
        "model_not_a_module": ({"model": 5}, {}, ["attach(model=int)", "torch.nn.Module"]),
        "log_dir_is_a_device": ({"monitor": {"log_dir": "/dev/null"}}, {}, ["'/dev/null'", "not writable"]),
    }


ATTACH_CASES = ["policy", "log_dir_number", "log_dir_top_level", "log_dir_empty", "log_dir_unwritable", "budget_nan",
                "runq_nan", "reserved_huge", "local_rank_text", "local_rank_beyond", "world_size_negative",
                "config_missing", "config_number", "config_no_value", "config_binary", "model_not_a_module",
                "log_dir_is_a_device"]


@pytest.mark.parametrize("case", ATTACH_CASES)
def test_attach(monkeypatch, tmp_path, bad, case):
    from placement.bind import session

    kwargs, env, needles = _attach_cases(tmp_path)[case]
    if kwargs.get("config") == "BINARY":
        kwargs = {"config": bad["binary.yaml"]}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PlacementError) as e:
        placement.attach(**kwargs)
    line = str(e.value)
    assert "\n" not in line and all(n in line for n in needles), line
    assert session.current() is None  # nothing bound, no stage 1
    assert frozenset(os.sched_getaffinity(0)) == CPUS
    assert not (tmp_path / "placement_logs").exists()


# ---- from outside: the real console script and the Hydra app, in parallel ----------------------
@pytest.mark.slow
def test_console_script_and_hydra_app_from_outside(tmp_path, bad):
    (tmp_path / "noop.py").write_text("open('worker-ran', 'w').close()\n")
    (tmp_path / "file").write_text("x")
    app = [sys.executable, str(REPO / "examples" / "hydra_app" / "train.py"), "train.steps=1",
           f"hydra.run.dir={tmp_path}/hydra"]
    cases = {
        "placerun_no_value": (console("placerun") + ["--standalone", "placement.policy", "noop.py"], 2,
                              ["placement.policy=VALUE", CHOICES_POLICY]),
        "placerun_binary_config": (console("placerun") + ["--standalone", "--placement-config", bad["binary.yaml"],
                                                          "noop.py"], 2, ["not UTF-8"]),
        "hydra_nan": (app + ["placement.monitor.budget_pct=nan"], 2, ["budget_pct", "nan"]),
        "hydra_log_dir": (app + [f"placement.monitor.log_dir={tmp_path}/file/logs"], 2, ["not writable"]),
        "hydra_reserved": (app + ["placement.reserved_cpus=0-99999999999"], 2, ["8192"]),
    }
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = {name: subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, (cmd, _, _) in cases.items()}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        _, rc, needles = cases[name]
        line = _one_line(err)
        assert p.returncode == rc and all(n in line for n in needles), (name, err)
    assert not (tmp_path / "worker-ran").exists()


@pytest.mark.slow
def test_hydra_app_bad_choice_is_hydras_own_error_with_the_choices(tmp_path):
    app = [sys.executable, str(REPO / "examples" / "hydra_app" / "train.py"), "train.steps=1",
           f"hydra.run.dir={tmp_path}/hydra", "placement.policy=fast"]
    p = subprocess.run(app, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "Invalid value 'fast', expected one of [auto, node, socket, exclusive, core-complex, none]" in p.stderr


# ---- settings in the environment (PLACEMENT_OVERRIDES, PLACEMENT_CONFIG) ------------------------
ENV_SETTINGS = [
    ("PLACEMENT_OVERRIDES", "placement.policy=fast", ["PLACEMENT_OVERRIDES='placement.policy=fast'", "auto"]),
    ("PLACEMENT_OVERRIDES", "placement.nope=1", ["PLACEMENT_OVERRIDES='placement.nope=1'", "nope"]),
    ("PLACEMENT_OVERRIDES", "placement.monitor.log_dir='x", ["PLACEMENT_OVERRIDES=", "does not split"]),
    ("PLACEMENT_CONFIG", "/nonexistent/p.yaml", ["PLACEMENT_CONFIG='/nonexistent/p.yaml'", "cannot read"]),
]


@pytest.mark.parametrize("var,value,needles", ENV_SETTINGS, ids=[f"{v}={x}" for v, x, _ in ENV_SETTINGS])
def test_placerun_settings_in_the_environment(placerun, monkeypatch, var, value, needles):
    monkeypatch.setenv(var, value)
    rc, line = placerun()
    assert rc == 2 and line.startswith("placerun: "), line
    for n in needles:
        assert n in line, line


@pytest.mark.parametrize("var,value,needles", ENV_SETTINGS[:1], ids=["policy"])
def test_attach_settings_in_the_environment(monkeypatch, var, value, needles):
    monkeypatch.setenv(var, value)
    with pytest.raises(PlacementError) as e:
        placement.attach(policy="none")
    for n in needles:
        assert n in str(e.value), str(e.value)
