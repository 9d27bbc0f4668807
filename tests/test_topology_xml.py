"""NCCL topology XML: GPU/NIC/NUMA/CPU-mask facts that win over sysfs for the devices they name."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from placement.cpuset import format_cpumask, parse_cpumask
from placement.errors import TopologyError
from placement.topology import discover
from sysfs_builder import SHARED, make_tree

AZURE = SHARED / "topologies" / "azure-ndv4-topo.xml"


def file_facts(path: Path) -> dict[str, dict]:
    """Per GPU bus id, straight from the file: numa, cpus, and the NIC bus ids under its switch."""
    facts = {}
    for cpu in ET.parse(path).getroot().iter("cpu"):
        for switch in cpu.iter("pci"):
            children = switch.findall("pci")
            nics = sorted(c.get("busid") for c in children if c.get("class", "").startswith("0x02"))
            for c in children:
                if c.get("class", "").startswith("0x03"):
                    facts[c.get("busid")] = {"numa": int(cpu.get("numaid")),
                                             "cpus": sorted(parse_cpumask(cpu.get("affinity"))), "nics": nics}
    return facts


@pytest.fixture
def azure() -> Path:
    if not AZURE.exists():
        pytest.skip(f"{AZURE} is absent")
    return AZURE


def test_azure_ndv4_gpus_numa_cpus_and_closest_nics(tmp_path, azure):
    topo = discover(make_tree(tmp_path, "small_cpu"), nccl_topo_file=str(azure))
    facts = file_facts(azure)
    assert len(facts) == 8 and len({f["numa"] for f in facts.values()}) == 4
    assert sorted(g.pci for g in topo.gpus) == sorted(facts)
    nic_pci = {n.name: n.pci for n in topo.nics}
    for g in topo.gpus:
        want = facts[g.pci]
        assert g.numa == want["numa"]
        assert g.cpus == want["cpus"]
        assert sorted(nic_pci[n] for n in g.nics) == want["nics"]
        assert all(g.nic_paths[n] == "PIX" for n in g.nics)
    # NICs only the XML knows are named by their PCI bus id.
    assert all(n.name == n.pci and n.kind == "infiniband" for n in topo.nics)
    assert len(topo.nics) == 8
    # GPU indices follow PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID).
    assert [g.pci for g in sorted(topo.gpus, key=lambda g: g.index)] == sorted(facts)


def write_xml(path: Path, body: str) -> str:
    path.write_text(f'<system version="1">{body}</system>')
    return str(path)


def test_xml_wins_over_sysfs_for_the_devices_it_names(tmp_path):
    """DGX fixture: the XML moves GPU 0000:18:00.0 under mlx5_4's switch on node 1."""
    root = make_tree(tmp_path, "dgx_h100")
    plain = discover(root)
    node1 = plain.node_cpus(1)
    xml = write_xml(tmp_path / "t.xml",
                    f'<cpu numaid="1" affinity="{format_cpumask(node1)}">'
                    '<pci busid="0000:99:00.0" class="0x060400">'
                    '<pci busid="0000:18:00.0" class="0x030200"/><pci busid="0000:9b:00.0" class="0x020700"/>'
                    '</pci></cpu>')
    topo = discover(root, nccl_topo_file=xml)
    gpu0 = topo.gpu_by_pci("0000:18:00.0")
    assert (gpu0.numa, frozenset(gpu0.cpus), gpu0.nics) == (1, node1, ["mlx5_4"])
    assert gpu0.nic_paths["mlx5_4"] == "PIX" and gpu0.nic_paths["mlx5_0"] == "SYS"
    # Devices the XML does not name keep their sysfs facts; the sysfs NIC keeps its name.
    assert topo.gpu_by_pci("0000:2a:00.0") == plain.gpu_by_pci("0000:2a:00.0")
    assert [n.name for n in topo.nics] == [n.name for n in plain.nics]


def test_xml_nested_switches_and_numa_fallback(tmp_path):
    xml = write_xml(tmp_path / "t.xml",
                    '<cpu numaid="0" affinity="0000000f">'
                    '<pci busid="0000:10:00.0" class="0x060400">'
                    '<pci busid="0000:11:00.0" class="0x060400"><pci busid="0000:12:00.0" class="0x030200"/></pci>'
                    '<pci busid="0000:13:00.0" class="0x060400"><pci busid="0000:14:00.0" class="0x020700"/></pci>'
                    '</pci>'
                    '<pci busid="0000:20:00.0" class="0x030200"/>'
                    '</cpu>'
                    '<cpu numaid="1" affinity="000000f0">'
                    '<pci busid="0000:30:00.0" class="0x030200"/><pci busid="0000:31:00.0" class="0x020000"/>'
                    '</cpu>')
    topo = discover(make_tree(tmp_path, "small_cpu"), nccl_topo_file=xml)
    g = {x.pci: x for x in topo.gpus}
    assert g["0000:12:00.0"].nic_paths == {"0000:14:00.0": "PXB", "0000:31:00.0": "SYS"}
    assert g["0000:12:00.0"].nics == ["0000:14:00.0"]
    assert g["0000:20:00.0"].nic_paths["0000:14:00.0"] == "PHB"
    assert g["0000:20:00.0"].nics == ["0000:14:00.0"]  # same NUMA node
    assert g["0000:30:00.0"].nics == ["0000:31:00.0"]
    assert {n.pci: n.kind for n in topo.nics} == {"0000:14:00.0": "infiniband", "0000:31:00.0": "ethernet"}
    assert g["0000:30:00.0"].cpus == [4, 5, 6, 7]


def test_malformed_xml_is_one_line_naming_the_path(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text('<system><cpu numaid="0">')
    with pytest.raises(TopologyError) as e:
        discover(make_tree(tmp_path, "small_cpu"), nccl_topo_file=str(bad))
    assert str(bad) in str(e.value) and "malformed XML" in str(e.value) and "\n" not in str(e.value)


def test_missing_xml_and_wrong_root_element(tmp_path):
    root = make_tree(tmp_path, "small_cpu")
    with pytest.raises(TopologyError, match="nope.xml: No such file"):
        discover(root, nccl_topo_file=str(tmp_path / "nope.xml"))
    other = tmp_path / "other.xml"
    other.write_text("<graphs/>")
    with pytest.raises(TopologyError, match=r"root element is <graphs>, expected <system>"):
        discover(root, nccl_topo_file=str(other))


def test_bad_affinity_mask(tmp_path):
    xml = write_xml(tmp_path / "t.xml", '<cpu numaid="0" affinity="zz"/>')
    with pytest.raises(TopologyError, match="bad cpu affinity 'zz'"):
        discover(make_tree(tmp_path, "small_cpu"), nccl_topo_file=xml)


def test_topo_file_rule_is_one_for_every_command(tmp_path):
    """An explicit file wins; $NCCL_TOPO_FILE counts for the live system only, never for a tree."""
    from placement.topology.nccl_xml import topo_file_for

    env = {"NCCL_TOPO_FILE": "/env.xml"}
    assert topo_file_for("/", "/arg.xml", "/cfg.xml", environ=env) == "/arg.xml"
    assert topo_file_for("/", None, "/cfg.xml", environ=env) == "/cfg.xml"
    assert topo_file_for("/", None, "", environ=env) == "/env.xml"
    assert topo_file_for(str(tmp_path), None, "", environ=env) is None
