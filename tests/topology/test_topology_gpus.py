"""GPUs: PCI sysfs discovery, NVML degrading quietly without a driver, PCI path classes, and
CUDA_VISIBLE_DEVICES (indices or UUIDs) mapping a local rank to its physical GPU."""
from __future__ import annotations

import logging
import shutil

import pytest

from placement.topology import discover, gpu_for_local_rank
from placement.topology.gpus import nvml_gpus
from placement.topology.pci import PciDevice, normalize_bdf, path_class
from sysfs_builder import (CLASS_3D, CLASS_BRIDGE, CLASS_IB, CLASS_VGA, INTEL, MELLANOX, NVIDIA, Machine, NicFacts,
                           PciFacts, make_machine_tree, make_tree, smp_cpus)


@pytest.fixture
def dgx(tmp_path):
    topo = discover(make_tree(tmp_path, "dgx_h100"))
    for g in topo.gpus:  # NVML would fill these on a real machine
        g.uuid = f"GPU-{g.index:08x}-aaaa-bbbb-cccc-{g.pci[5:7]}0000000000"
    return topo


def test_cuda_visible_devices_unset_is_pci_order(dgx):
    assert [gpu_for_local_rank(dgx, r, None).pci for r in range(8)] == sorted(g.pci for g in dgx.gpus)
    assert gpu_for_local_rank(dgx, 8, None) is None


def test_cuda_visible_devices_indices(dgx):
    assert gpu_for_local_rank(dgx, 0, "6,2").index == 6
    assert gpu_for_local_rank(dgx, 1, "6,2").index == 2
    assert gpu_for_local_rank(dgx, 2, "6,2") is None
    assert gpu_for_local_rank(dgx, 0, "") is None


def test_cuda_visible_devices_uuids_and_prefixes(dgx):
    g5, g3 = dgx.gpus[5], dgx.gpus[3]
    assert gpu_for_local_rank(dgx, 0, f"{g5.uuid},{g3.uuid}") is g5
    assert gpu_for_local_rank(dgx, 1, f"{g5.uuid}, {g3.uuid[:12]}") is g3
    assert gpu_for_local_rank(dgx, 0, "GPU-") is None  # ambiguous prefix names no single GPU


def test_cuda_visible_devices_stop_at_first_invalid_entry(dgx):
    # As CUDA does: "0,1,-1,2" makes only devices 0 and 1 visible.
    assert gpu_for_local_rank(dgx, 1, "0,1,-1,2").index == 1
    assert gpu_for_local_rank(dgx, 2, "0,1,-1,2") is None
    assert gpu_for_local_rank(dgx, 0, "MIG-1234") is None
    assert gpu_for_local_rank(dgx, 0, "9") is None


def test_nvml_degrades_quietly_without_a_driver(caplog, capsys):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present: NVML loads here")
    except pynvml.NVMLError:
        pass
    with caplog.at_level(logging.DEBUG, logger="placement.topology"):
        assert nvml_gpus() is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert capsys.readouterr() == ("", "")


@pytest.mark.gpu
def test_nvml_gpus_match_sysfs_on_a_gpu_machine():
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU/driver on this machine")
    gpus = nvml_gpus()
    assert gpus, "NVML loaded but reported no GPU"
    topo = discover("/")
    assert [g.pci for g in topo.gpus] == sorted(g.pci for g in gpus)
    assert all(g.uuid and g.uuid.startswith("GPU-") and g.name for g in topo.gpus)
    assert all(g.numa is not None and g.cpus for g in topo.gpus)


def test_sysfs_gpus_are_nvidia_display_or_3d_functions_only(tmp_path):
    cpus = smp_cpus(1, 4, 1)
    local = frozenset(range(4))
    pci = [PciFacts("0000:01:00.0", "pci0000:00", None, CLASS_3D, NVIDIA, 0x2330, 0, local),
           PciFacts("0000:02:00.0", "pci0000:00", None, CLASS_VGA, NVIDIA, 0x2204, 0, local),
           PciFacts("0000:02:00.1", "pci0000:00", None, 0x040300, NVIDIA, 0x1AEF, 0, local),  # its HDMI audio
           PciFacts("0000:03:00.0", "pci0000:00", None, 0x068000, NVIDIA, 0x22A3, 0, local),  # NVSwitch
           PciFacts("0000:04:00.0", "pci0000:00", None, CLASS_VGA, 0x1A03, 0x2000, 0, local)]  # BMC VGA
    root = make_machine_tree(tmp_path, Machine(cpus, {0: 1000}, {0: {0: 10}}, pci))
    assert [g.pci for g in discover(root).gpus] == ["0000:01:00.0", "0000:02:00.0"]


def test_path_classes_from_the_pci_tree(tmp_path):
    """Two-level switch: GPU and NIC under the same leaf switch are PIX, under different leaf
    switches of one upper switch PXB; root ports of one host bridge PHB."""
    local = frozenset(range(4))
    br = dict(cls=CLASS_BRIDGE, vendor=INTEL, numa_node=0, local_cpus=local)
    hb = "pci0000:00"
    pci = [PciFacts("0000:00:01.0", hb, None, **br), PciFacts("0000:01:00.0", hb, "0000:00:01.0", **br),
           PciFacts("0000:02:00.0", hb, "0000:01:00.0", **br), PciFacts("0000:02:01.0", hb, "0000:01:00.0", **br),
           PciFacts("0000:03:00.0", hb, "0000:02:00.0", **br),  # leaf switch A upstream port
           PciFacts("0000:04:00.0", hb, "0000:03:00.0", **br), PciFacts("0000:04:01.0", hb, "0000:03:00.0", **br),
           PciFacts("0000:05:00.0", hb, "0000:04:00.0", CLASS_3D, NVIDIA, 0x20B0, 0, local),
           PciFacts("0000:06:00.0", hb, "0000:04:01.0", CLASS_IB, MELLANOX, 0x101B, 0, local),
           PciFacts("0000:07:00.0", hb, "0000:02:01.0", CLASS_IB, MELLANOX, 0x101B, 0, local),
           PciFacts("0000:00:02.0", hb, None, **br),
           PciFacts("0000:08:00.0", hb, "0000:00:02.0", CLASS_IB, MELLANOX, 0x101B, 0, local)]
    nics = [NicFacts("mlx5_0", "0000:06:00.0", "infiniband"), NicFacts("mlx5_1", "0000:07:00.0", "infiniband"),
            NicFacts("mlx5_2", "0000:08:00.0", "infiniband")]
    [gpu] = discover(make_machine_tree(tmp_path, Machine(smp_cpus(1, 4, 1), {0: 1000}, {0: {0: 10}}, pci, nics))).gpus
    assert gpu.nic_paths == {"mlx5_0": "PIX", "mlx5_1": "PXB", "mlx5_2": "PHB"}
    assert gpu.nics == ["mlx5_0"]


def test_path_class_across_host_bridges():
    a = PciDevice("0000:18:00.0", "pci0000:15", ("0000:15:01.0", "0000:18:00.0"), numa=0)
    b = PciDevice("0000:2b:00.0", "pci0000:27", ("0000:27:01.0", "0000:2b:00.0"), numa=0)
    c = PciDevice("0000:9b:00.0", "pci0000:97", ("0000:97:01.0", "0000:9b:00.0"), numa=1)
    assert (path_class(a, b), path_class(a, c), path_class(b, c)) == ("NODE", "SYS", "SYS")


def test_normalize_bdf():
    assert normalize_bdf("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_bdf("0000:1A:00.0") == "0000:1a:00.0"
    assert normalize_bdf("10000:01:00.0") == "10000:01:00.0"  # VMD domains are wider than 4 digits
