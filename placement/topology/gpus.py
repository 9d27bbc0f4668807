"""GPUs: NVML (pynvml) on the live system when it loads, else NVIDIA display/3D devices in PCI
sysfs; and which physical GPU a local rank uses under CUDA_VISIBLE_DEVICES.

GPUs are indexed in PCI bus order, the order CUDA uses with CUDA_DEVICE_ORDER=PCI_BUS_ID
(which placerun sets when unset) and NVML's own.
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


def gpu_for_local_rank(topo: Topology, local_rank: int, cuda_visible_devices: Optional[str]) -> Optional[Gpu]:
    """The physical GPU local rank N uses: CUDA device N, after CUDA_VISIBLE_DEVICES.

    cuda_visible_devices: None (unset: all GPUs in PCI order), or CUDA's comma list of
    indices or UUIDs (a unique "GPU-..." prefix is enough). As CUDA does, the list stops at
    its first entry that names no GPU. None when the rank has no GPU.
    """
    by_index = sorted(topo.gpus, key=lambda g: g.index)
    if cuda_visible_devices is None:
        return by_index[local_rank] if 0 <= local_rank < len(by_index) else None
    visible: list[Gpu] = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        gpu = _gpu_named(by_index, entry)
        if gpu is None or gpu in visible:
            break
        visible.append(gpu)
    return visible[local_rank] if 0 <= local_rank < len(visible) else None


def _gpu_named(gpus: list[Gpu], entry: str) -> Optional[Gpu]:
    if entry.isdigit():
        index = int(entry)
        return next((g for g in gpus if g.index == index), None)
    if entry.upper().startswith("GPU-"):
        want = entry.lower()
        matches = [g for g in gpus if g.uuid and g.uuid.lower().startswith(want)]
        return matches[0] if len(matches) == 1 else None
    return None
