"""GPUs: NVML (pynvml) on the live system when it loads, else NVIDIA display/3D devices in PCI
sysfs; and which physical GPU a local rank uses under CUDA_VISIBLE_DEVICES.

GPUs are indexed in PCI bus order, the order CUDA uses with CUDA_DEVICE_ORDER=PCI_BUS_ID
(which placerun sets when unset) and NVML's own.

MIG: CUDA_VISIBLE_DEVICES may name MIG devices (`MIG-<uuid>`, what the Kubernetes device plugin
hands out, or the pre-R470 form `MIG-GPU-<parent uuid>/<gi>/<ci>`). A MIG device has no PCI
function of its own: its CPUs and NUMA node are its parent GPU's. NVML maps it (nvidia-ml-py):
nvmlDeviceGetHandleByUUID(mig uuid) -> nvmlDeviceIsMigDeviceHandle -> 
nvmlDeviceGetDeviceHandleFromMigDeviceHandle -> nvmlDeviceGetPciInfo(parent).busId; the MIG
devices there are, for messages, from nvmlDeviceGetMaxMigDeviceCount and
nvmlDeviceGetMigDeviceHandleByIndex on every GPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from placement.topology._sysfs import SysfsReader
from placement.topology.model import Gpu, Topology
from placement.topology.pci import BUS_DIR, normalize_bdf

log = logging.getLogger(__name__)

NVIDIA = 0x10DE
_GPU_CLASSES = (0x0300, 0x0302)  # VGA-compatible, 3D controller


@dataclass(frozen=True)
class NvmlGpu:
    pci: str
    uuid: Optional[str]
    name: Optional[str]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Why the last nvml_gpus() call could not use NVML (None: it could); `placement topo` and
# `placement doctor` say it in one info line.
nvml_unavailable: Optional[str] = None


def nvml_gpus() -> Optional[list[NvmlGpu]]:
    """GPUs NVML reports, or None when NVML cannot be used (no driver, no library); the reason
    is kept in `nvml_unavailable`."""
    global nvml_unavailable
    try:
        import pynvml
    except ImportError as e:
        nvml_unavailable = f"nvidia-ml-py is not installed ({e}); pip install nvidia-ml-py"
        log.debug("NVML unavailable (%s); GPUs from PCI sysfs", e)
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # any NVMLError: no usable driver here
        nvml_unavailable = f"NVML did not load ({type(e).__name__}: {e})"
        log.debug("NVML unavailable (%s); GPUs from PCI sysfs", e)
        return None
    nvml_unavailable = None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pci = normalize_bdf(_text(pynvml.nvmlDeviceGetPciInfo(h).busId))
            out.append(NvmlGpu(pci, _text(pynvml.nvmlDeviceGetUUID(h)), _text(pynvml.nvmlDeviceGetName(h))))
        return out
    except Exception as e:
        nvml_unavailable = f"an NVML query failed ({type(e).__name__}: {e})"
        log.debug("NVML query failed (%s); GPUs from PCI sysfs", e)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as e:
            log.debug("nvmlShutdown: %s", e)


@dataclass(frozen=True)
class MigDevice:
    uuid: str
    parent_pci: str


@dataclass
class MigLookup:
    """MIG entries of CUDA_VISIBLE_DEVICES resolved through NVML."""

    parents: dict[str, Optional[str]]  # entry -> its parent GPU's PCI bus id (None: no such MIG device)
    devices: list[MigDevice]  # every MIG device NVML lists
    error: Optional[str] = None  # why NVML could not be asked (then every parent is None)

    def describe(self) -> str:
        if self.error:
            return f"MIG devices unknown ({self.error})"
        if not self.devices:
            return "MIG devices: none (NVML lists no MIG device)"
        return "MIG devices: " + ", ".join(f"{d.uuid} (on GPU {d.parent_pci})" for d in self.devices)


def is_mig_entry(entry: str) -> bool:
    return entry.strip().upper().startswith("MIG-")


def _value(x):
    return getattr(x, "value", x)  # pynvml returns some results as ctypes c_uint


def lookup_mig(entries: list[str]) -> MigLookup:
    """Parent GPU PCI bus id of each MIG entry, asked of NVML once; never raises."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:
        return MigLookup({e_: None for e_ in entries}, [], f"NVML is not available: {e}")
    try:
        devices = _mig_devices(pynvml)
        parents: dict[str, Optional[str]] = {}
        for entry in entries:
            parents[entry] = _mig_parent(pynvml, entry.strip(), devices)
        return MigLookup(parents, devices)
    except Exception as e:
        return MigLookup({e_: None for e_ in entries}, [], f"NVML query failed: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as e:
            log.debug("nvmlShutdown: %s", e)


def _mig_devices(pynvml) -> list[MigDevice]:
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(i)
        pci = normalize_bdf(_text(pynvml.nvmlDeviceGetPciInfo(gpu).busId))
        try:
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu)
        except pynvml.NVMLError:  # not MIG-capable
            continue
        for k in range(slots):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, k)
            except pynvml.NVMLError:  # an empty slot
                continue
            out.append(MigDevice(_text(pynvml.nvmlDeviceGetUUID(mig)), pci))
    return out


def _mig_parent(pynvml, entry: str, devices: list[MigDevice]) -> Optional[str]:
    if entry.upper().startswith("MIG-GPU-"):  # pre-R470: MIG-GPU-<parent uuid>/<gi>/<ci>
        parent_uuid = entry[4:].split("/", 1)[0]
        try:
            gpu = pynvml.nvmlDeviceGetHandleByUUID(parent_uuid)
        except pynvml.NVMLError:
            return None
        return normalize_bdf(_text(pynvml.nvmlDeviceGetPciInfo(gpu).busId))
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
    except pynvml.NVMLError:
        matches = [d for d in devices if d.uuid.lower().startswith(entry.lower())]  # a unique prefix, as CUDA
        return matches[0].parent_pci if len(matches) == 1 else None
    if not _value(pynvml.nvmlDeviceIsMigDeviceHandle(handle)):
        return None  # a full GPU's uuid written with MIG-: not a MIG device
    parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    return normalize_bdf(_text(pynvml.nvmlDeviceGetPciInfo(parent).busId))


def sysfs_gpu_bdfs(fs: SysfsReader) -> list[str]:
    """NVIDIA display/3D functions in bus/pci/devices (the vendor is read first: one file for most)."""
    out = []
    for bdf in sorted(fs.listdir(BUS_DIR) or []):
        d = f"{BUS_DIR}/{bdf}"
        if fs.integer(f"{d}/vendor", 16) != NVIDIA:
            continue
        cls = fs.integer(f"{d}/class", 16)
        if cls is not None and cls >> 8 in _GPU_CLASSES:
            out.append(normalize_bdf(bdf))
    return out


def gpu_for_local_rank(topo: Topology, local_rank: int, cuda_visible_devices: Optional[str],
                       mig: Optional[MigLookup] = None) -> Optional[Gpu]:
    """The physical GPU local rank N uses: CUDA device N, after CUDA_VISIBLE_DEVICES.

    cuda_visible_devices: None (unset: all GPUs in PCI order), or CUDA's comma list of
    indices or UUIDs (a unique "GPU-..." prefix is enough), or MIG device UUIDs, which stand
    for their parent GPU (resolved in `mig`, else through NVML here). As CUDA does, the list
    stops at its first entry that names no GPU. None when the rank has no GPU.
    """
    if cuda_visible_devices is not None and mig is None:
        migs = [e for e in cuda_visible_devices.split(",") if is_mig_entry(e)]
        mig = lookup_mig(migs) if migs else None
    by_index = sorted(topo.gpus, key=lambda g: g.index)
    if cuda_visible_devices is None:
        return by_index[local_rank] if 0 <= local_rank < len(by_index) else None
    visible: list[Gpu] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        gpu = _gpu_named(topo, by_index, entry, mig)
        if gpu is None or (gpu in visible and not is_mig_entry(entry)):
            break
        visible.append(gpu)
    return visible[local_rank] if 0 <= local_rank < len(visible) else None


def _gpu_named(topo: Topology, gpus: list[Gpu], entry: str, mig: Optional[MigLookup]) -> Optional[Gpu]:
    if is_mig_entry(entry):
        pci = None if mig is None else mig.parents.get(entry)
        return None if pci is None else topo.gpu_by_pci(pci)
    if entry.isdigit():
        index = int(entry)
        return next((g for g in gpus if g.index == index), None)
    if entry.upper().startswith("GPU-"):
        want = entry.lower()
        matches = [g for g in gpus if g.uuid and g.uuid.lower().startswith(want)]
        return matches[0] if len(matches) == 1 else None
    return None
