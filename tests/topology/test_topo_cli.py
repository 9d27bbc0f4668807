"""`placement topo`: JSON is Topology.to_dict(); the human view per NUMA node then a GPU x NIC
matrix; bad input is one line on stderr and exit code 2; per-file warnings go to stderr."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
import subprocess
import sys
from pathlib import Path

import pytest

from placement.cli import main
from placement.topology import SCHEMA, discover
from sysfs_builder import make_tree


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["topo", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_is_the_topology_dict(tmp_path, capsys):
    root = make_tree(tmp_path, "dgx_h100")
    rc, out, err = run_cli(capsys, "--root", root, "--json")
    assert (rc, err) == (0, "")
    data = json.loads(out)
    assert data["schema"] == SCHEMA
    assert data == json.loads(json.dumps(discover(root).to_dict()))


def test_human_view_per_node_and_gpu_nic_matrix(tmp_path, capsys):
    root = make_tree(tmp_path, "dgx_h100")
    topo = discover(root)
    rc, out, _ = run_cli(capsys, "--root", root)
    assert rc == 0
    for node in topo.numa_nodes:
        section = out.split(f"NUMA node {node.id}", 1)[1].split("\n\n", 1)[0]
        assert "CPUs      0-55,112-167" in section if node.id == 0 else "56-111,168-223" in section
        assert "56 physical, 2 thread(s) each" in section
        gpus = [g for g in topo.gpus if g.numa == node.id]
        assert all(f"{g.index} ({g.pci})" in section for g in gpus)
        assert all(n.name in section for n in topo.nics if n.numa == node.id)
    matrix = out.split("GPU x NIC", 1)[1].splitlines()
    header = matrix[0].split()
    assert header == [n.name for n in topo.nics]
    for g, line in zip(topo.gpus, matrix[1:]):
        cells = line.split()
        assert cells[0] == f"GPU{g.index}"
        assert cells[1:1 + len(header)] == [g.nic_paths[n] for n in header]
    assert "PIX = " in out


def test_fastest_cores_named(tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "--root", make_tree(tmp_path, "small_cpu"))
    assert rc == 0
    assert "fastest   2,5,10,13 (2 cores, perf_rank 0, 5.20 GHz)" in out


def test_allowed_subset_shown(tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "--root", make_tree(tmp_path, "container_cgroup2"))
    assert rc == 0 and "(allowed: 8-15,40-47)" in out


def test_nccl_topo_file_flag(tmp_path, capsys):
    xml = Path(__file__).resolve().parents[3] / "shared" / "topologies" / "azure-ndv4-topo.xml"
    if not xml.exists():
        pytest.skip(f"{xml} is absent")
    from sysfs_builder import cloud_vm_flat, make_machine_tree

    gpus = sorted(p.get("busid") for p in ET.parse(xml).getroot().iter("pci") if p.get("class") == "0x030200")
    root = make_machine_tree(tmp_path, cloud_vm_flat(4, 24, gpus))
    rc, out, _ = run_cli(capsys, "--root", root, "--nccl-topo-file", str(xml), "--json")
    assert rc == 0 and len(json.loads(out)["gpus"]) == 8


def test_bad_root_is_one_line_and_exit_2(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "--root", str(tmp_path / "missing"))
    assert rc == 2 and out == ""
    assert err == f"placement topo: topology root {tmp_path / 'missing'} does not exist\n"
    rc, _, err = run_cli(capsys, "--root", str(tmp_path))
    assert rc == 2 and err.count("\n") == 1 and "has no sys/devices/system/cpu" in err


def test_malformed_xml_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "topo.xml"
    bad.write_text("<system><cpu>")
    rc, out, err = run_cli(capsys, "--root", make_tree(tmp_path, "small_cpu"), "--nccl-topo-file", str(bad))
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert str(bad) in err and "malformed XML" in err


def test_bad_file_warns_on_stderr_and_still_succeeds(tmp_path, capsys):
    root = Path(make_tree(tmp_path, "small_cpu"))
    bad = root / "sys/devices/system/node/node0/meminfo"
    bad.write_text("garbage\n")
    rc, out, err = run_cli(capsys, "--root", str(root), "--json")
    assert rc == 0
    assert json.loads(out)["numa_nodes"][0]["memory_bytes"] is None
    assert err == f"placement topo: warning: {bad}: no MemTotal line\n"


def test_console_script_on_the_live_machine():
    run = subprocess.run([sys.executable, "-m", "placement.cli", "topo", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["root"] == "/" and any(c["online"] for c in data["cpus"])
