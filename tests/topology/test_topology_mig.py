"""CUDA_VISIBLE_DEVICES naming MIG devices (what the Kubernetes device plugin hands out): each
stands for its parent GPU, found through NVML's MIG handles (tests/fake_nvml.py stands in for
the driver), so the rank's CPUs and NUMA node are the parent's. Bad MIG input is one line naming
the entry and the devices found, exit 2 under strict."""
import pytest

from placement import cli
from placement.config import load_config
from placement.errors import PlanError
from placement.plan import plan_for_node
from placement.topology import discover

from fake_nvml import FakeGpu, FakeNvml
from plan_checks import check_auto
from sysfs_builder import make_tree

MIG_ON_3 = "MIG-5c3b0f6a-1d2e-5f4a-9b8c-7d6e5f4a3b21"
MIG_ON_3_B = "MIG-0a1b2c3d-4e5f-5a6b-8c7d-9e0f1a2b3c4d"
MIG_ON_6 = "MIG-9f8e7d6c-5b4a-5392-8170-6f5e4d3c2b1a"


@pytest.fixture(scope="module")
def dgx_root(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("dgx"), "dgx_h100")


@pytest.fixture
def nvml(dgx_root, monkeypatch):
    topo = discover(dgx_root)
    gpus = [FakeGpu(g.pci, f"GPU-{g.index:08x}-aaaa-bbbb-cccc-dddddddddddd") for g in topo.gpus]
    gpus[3].migs = [MIG_ON_3, MIG_ON_3_B]
    gpus[6].migs = [MIG_ON_6]
    fake = FakeNvml(gpus)
    fake.install(monkeypatch)
    return fake


def plan(dgx_root, cvd, nproc=1, *overrides):
    cfg = load_config(list(overrides))
    topo, p = plan_for_node(cfg, nproc, root=dgx_root, environ={"CUDA_VISIBLE_DEVICES": cvd})
    check_auto(topo, p, cfg)
    return topo, p


def test_a_mig_device_is_planned_as_its_parent_gpu(dgx_root, nvml):
    topo, p = plan(dgx_root, MIG_ON_6)
    (r,) = p.ranks
    assert r.gpu.index == 6 and r.gpu.pci == topo.gpus[6].pci
    node = topo.gpus[6].numa
    assert node == 1 and r.numa == [node] and r.memory.nodes == [node]
    assert r.share() <= frozenset(topo.gpus[6].cpus)
    assert not any("like CUDA" in w for w in p.warnings)
    assert nvml.inits == 0  # NVML shut down again


def test_two_mig_devices_of_one_gpu_share_its_node(dgx_root, nvml):
    topo, p = plan(dgx_root, f"{MIG_ON_3},{MIG_ON_3_B}", 2)
    assert [r.gpu.index for r in p.ranks] == [3, 3]
    assert {r.numa[0] for r in p.ranks} == {topo.gpus[3].numa}
    assert not p.ranks[0].share() & p.ranks[1].share()


def test_legacy_mig_gpu_form_maps_to_the_parent_by_its_uuid(dgx_root, nvml):
    _, p = plan(dgx_root, f"MIG-{nvml.gpus[6].uuid}/1/0")
    assert p.ranks[0].gpu.index == 6


def test_a_mig_id_matching_no_mig_device_is_one_line_naming_it_and_the_devices(dgx_root, nvml):
    bad = "MIG-00000000-0000-0000-0000-000000000000"
    with pytest.raises(PlanError) as e:
        plan(dgx_root, bad, 1, "strict=true")
    msg = str(e.value)
    assert "\n" not in msg and f"entry {bad!r}" in msg and "matches no MIG device" in msg
    assert MIG_ON_3 in msg and MIG_ON_6 in msg and "0000:18:00.0" in msg


def test_mixing_mig_and_gpu_ids_is_refused_naming_the_entry(dgx_root, nvml):
    with pytest.raises(PlanError) as e:
        plan(dgx_root, f"{MIG_ON_6},2", 2, "strict=true")
    msg = str(e.value)
    assert "\n" not in msg and "entry '2'" in msg and "among MIG devices" in msg and MIG_ON_6 in msg


def test_bad_mig_input_exits_2_from_placement_plan(dgx_root, nvml, monkeypatch, capsys):
    for cvd in ("MIG-ffffffff-0000-0000-0000-000000000000", f"0,{MIG_ON_3}"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
        rc = cli.main(["plan", "--root", dgx_root, "--nproc-per-node", "1", "placement.strict=true"])
        out, err = capsys.readouterr()
        assert rc == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and "CUDA_VISIBLE_DEVICES entry" in err


def test_strict_false_degrades_like_cuda_and_says_so(dgx_root, nvml):
    _, p = plan(dgx_root, f"{MIG_ON_6},MIG-ffffffff-0000-0000-0000-000000000000", 1)  # the default
    assert p.ranks[0].gpu.index == 6
    assert any("matches no MIG device" in w and "degraded plan" in w for w in p.warnings)


def test_without_nvml_a_mig_entry_says_why_it_cannot_be_resolved(dgx_root, monkeypatch):
    import pynvml

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with pytest.raises(PlanError) as e:
        plan(dgx_root, MIG_ON_6, 1, "strict=true")
    assert "NVML is not available" in str(e.value) and MIG_ON_6 in str(e.value)
