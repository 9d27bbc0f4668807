"""NCCL topology XML: GPU/NIC/NUMA/CPU-mask facts that win over sysfs for the devices they name."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from placement.cpuset import format_cpumask, parse_cpumask
from placement.errors import TopologyError
from placement.topology import discover
from sysfs_builder import SHARED, cloud_vm_bridged, cloud_vm_flat, make_machine_tree, make_tree

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
    facts = file_facts(azure)
    # The VM's sysfs shows the GPUs (each on its own host bridge, numa_node -1); the file places them.
    topo = discover(make_machine_tree(tmp_path, cloud_vm_flat(4, 24, sorted(facts))), nccl_topo_file=str(azure))
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
                    '<pci busid="0000:11:00.0" class="0x060400"><pci busid="0000:12:00.0" class="0x030200">'
                    '<gpu dev="0" rank="0"/></pci></pci>'
                    '<pci busid="0000:13:00.0" class="0x060400"><pci busid="0000:14:00.0" class="0x020700"/></pci>'
                    '</pci>'
                    '<pci busid="0000:20:00.0" class="0x030200"><gpu dev="1" rank="1"/></pci>'
                    '</cpu>'
                    '<cpu numaid="1" affinity="000000f0">'
                    '<pci busid="0000:30:00.0" class="0x030200"><gpu dev="2" rank="2"/></pci>'
                    '<pci busid="0000:31:00.0" class="0x020000"/>'
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


# ---- the four shapes clouds ship (built by code in the shape of the public files: Azure/azhpc-images
# topology/ncv4-topo.xml, aws/aws-ofi-nccl topology/g5.48xl-topo.xml; NCCL's own multi-host dumps)

def test_gpus_only_in_the_file_without_gpu_rank_do_not_shift_gpu_indices(tmp_path):
    """NCCL ignores a GPU <pci> without <gpu rank> (topo.cc:440-447): it only places a GPU it has."""
    root = make_tree(tmp_path, "dgx_h100")
    plain = discover(root)
    node1 = plain.node_cpus(1)
    xml = write_xml(tmp_path / "t.xml",
                    f'<cpu numaid="1" affinity="{format_cpumask(node1)}">'
                    '<pci busid="0000:07:00.0" class="0x030200"/>'  # not on this machine, sorts first
                    '<pci busid="0000:18:00.0" class="0x030200"/>'  # on it: placed on node 1
                    '</cpu>')
    topo = discover(root, nccl_topo_file=xml)
    assert [g.pci for g in topo.gpus] == [g.pci for g in plain.gpus]  # same GPUs, same indices
    assert [g.index for g in topo.gpus] == list(range(8))
    assert topo.gpu_by_pci("0000:07:00.0") is None
    assert topo.gpu_by_pci("0000:18:00.0").numa == 1
    ranked = write_xml(tmp_path / "r.xml", f'<cpu numaid="1" affinity="{format_cpumask(node1)}">'
                       '<pci busid="0000:07:00.0" class="0x030200"><gpu dev="0" rank="0"/></pci></cpu>')
    assert discover(root, nccl_topo_file=ranked).gpu_by_pci("0000:07:00.0") is not None  # NCCL counts it


def ncv4_like(gpus: list[str], nodes_cpus: list[frozenset]) -> str:
    """One <cpu> per node, each with its GPU (<gpu dev rank> + NVLink) and, on node 0, a <nic>
    directly under the <cpu> holding only <net name="eth0"> (the socket transport's netdev)."""
    body = ""
    for node, (bdf, cpus) in enumerate(zip(gpus, nodes_cpus)):
        nic = ('<nic><net name="eth0" dev="0" speed="100000" port="0" latency="0.000000" guid="0x0" '
               'maxconn="65536" gdr="0"/></nic>') if node == 0 else ""
        body += (f'<cpu numaid="{node}" affinity="{format_cpumask(cpus)}" arch="x86_64" vendor="AuthenticAMD">'
                 f'<pci busid="{bdf}" class="0x030200" vendor="0x10de" device="0x20b5" link_speed="" link_width="0">'
                 f'<gpu dev="{node}" sm="80" rank="{node}" gdr="1"><nvlink target="{bdf}" count="12" '
                 'tclass="0x030200"/></gpu></pci>' + nic + '</cpu>')
    return body


def test_azure_ncv4_nic_directly_under_a_cpu_is_kept_with_its_node(tmp_path):
    gpus = [f"000{i}:00:00.0" for i in range(1, 5)]
    machine = cloud_vm_flat(4, 24, gpus)
    plain = discover(make_machine_tree(tmp_path, machine))
    nodes = [plain.node_cpus(n) for n in range(4)]
    xml = write_xml(tmp_path / "ncv4.xml", ncv4_like(gpus, nodes))
    topo = discover(make_machine_tree(tmp_path, machine, "vm2"), nccl_topo_file=xml)
    assert [(g.pci, g.numa, frozenset(g.cpus)) for g in topo.gpus] == list(zip(gpus, range(4), nodes))
    (eth0,) = [n for n in topo.nics if n.name == "eth0"]
    assert eth0.numa == 0 and eth0.pci is None
    g0, g1 = topo.gpus[0], topo.gpus[1]
    assert g0.nics == ["eth0"] and g0.nic_paths["eth0"] == "PHB"  # through the same CPU
    assert g1.nic_paths["eth0"] == "SYS"


def test_aws_g5_partial_file_places_the_sysfs_gpus_under_its_bridges(tmp_path):
    bridges = [f"0000:00:{b:02x}.0" for b in range(0x16, 0x1e)]
    machine = cloud_vm_bridged(2, 8, bridges)
    root = make_machine_tree(tmp_path, machine)
    plain = discover(root)
    assert {g.numa for g in plain.gpus} <= {None, 0}  # sysfs alone: numa_node -1, nothing placed
    # The shape of g5.48xl-topo.xml: bare <cpu numaid> with bare <pci busid> bridges, 4 per node.
    body = "".join(f'<cpu numaid="{n}">' + "".join(f'<pci busid="{b}"/>' for b in bridges[4 * n:4 * n + 4]) + "</cpu>"
                   for n in range(2))
    topo = discover(root, nccl_topo_file=write_xml(tmp_path / "g5.xml", body))
    assert [g.index for g in topo.gpus] == list(range(8))
    for g in topo.gpus:
        node = 0 if g.index < 4 else 1
        assert g.numa == node and frozenset(g.cpus) == topo.node_cpus(node), g


def test_multi_host_dump_keeps_this_hosts_cpus_by_host_hash(tmp_path):
    from placement.topology.nccl_xml import nccl_host_hash

    root = make_tree(tmp_path, "dgx_h100")
    kernel = Path(root) / "proc/sys/kernel"
    (kernel / "random").mkdir(parents=True, exist_ok=True)
    (kernel / "hostname").write_text("gpu-node-01\n")
    (kernel / "random/boot_id").write_text("7c1b3a2e-9d4f-4b7a-8e21-5f6a7b8c9d0e\n")
    # NCCL v2.28.9-1 getHash("gpu-node-01" + boot_id), from src/include/bitops.h compiled with g++
    ours = 0x0BA1A868BC0D189E
    assert nccl_host_hash(root) == ours
    node0, node1 = discover(root).node_cpus(0), discover(root).node_cpus(1)

    def host(h, node, cpus):
        return (f'<cpu numaid="{node}" affinity="{format_cpumask(cpus)}" host_hash="{h:#x}">'
                '<pci busid="0000:18:00.0" class="0x030200"><gpu dev="0" rank="0"/></pci>'
                f'<pci busid="0000:0{node + 5}:00.0" class="0x030200"><gpu dev="1" rank="1"/></pci></cpu>')

    other = 0x1234567890ABCDEF
    dump = write_xml(tmp_path / "dump.xml", host(other, 0, node0) + host(ours, 1, node1))
    topo = discover(root, nccl_topo_file=dump)
    assert topo.gpu_by_pci("0000:18:00.0").numa == 1  # this host's <cpu>, not the other host's
    assert topo.gpu_by_pci("0000:06:00.0") is not None and topo.gpu_by_pci("0000:05:00.0") is None
    (kernel / "random/boot_id").write_text("00000000-0000-0000-0000-000000000000\n")  # rebooted
    topo = discover(root, nccl_topo_file=dump)
    assert topo.gpu_by_pci("0000:18:00.0").numa == 0  # the first host's, and said
    assert any("describes 2 hosts" in w and "using the first host" in w for w in topo.warnings)
