"""A stand-in for the NVIDIA driver behind nvidia-ml-py (`pynvml`), for machines without a GPU:
the real pynvml module with its NVML calls replaced, so error classes, constants and return
types are pynvml's own. What it reproduces (NVML API reference, nvml.h, and pynvml's wrappers):
- nvmlDeviceGetHandleByUUID accepts a GPU's or a MIG device's UUID and raises
  NVMLError(NVML_ERROR_NOT_FOUND) for anything else;
- nvmlDeviceIsMigDeviceHandle returns a ctypes c_uint (pynvml returns the c_uint itself);
- nvmlDeviceGetMaxMigDeviceCount is NOT_SUPPORTED on a GPU without MIG; on a MIG-enabled GPU,
  nvmlDeviceGetMigDeviceHandleByIndex raises NOT_FOUND for an empty slot;
- nvmlDeviceGetPciInfo(...).busId is bytes with an 8-digit domain ("00000000:18:00.0");
- a MIG handle's parent comes from nvmlDeviceGetDeviceHandleFromMigDeviceHandle.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml


@dataclass
class FakeGpu:
    pci: str  # "0000:18:00.0"
    uuid: str
    migs: list[str] = field(default_factory=list)  # MIG device UUIDs; empty: MIG disabled
    mig_slots: int = 7


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int = -1  # index among the GPU's MIG devices; -1: the GPU itself


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu]):
        self.gpus = gpus
        self.inits = 0

    def install(self, monkeypatch) -> None:
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, getattr(self, name))

    @staticmethod
    def _error(code):
        return pynvml.NVMLError(code)

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.gpus):
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, g in enumerate(self.gpus):
            if g.uuid == uuid:
                return _Handle(i)
            if uuid in g.migs:
                return _Handle(i, g.migs.index(uuid))
        raise self._error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, h):
        g = self.gpus[h.gpu]
        return g.uuid if h.mig < 0 else g.migs[h.mig]

    def nvmlDeviceGetName(self, h):
        return "NVIDIA A100-SXM4-80GB" if h.mig < 0 else "NVIDIA A100-SXM4-80GB MIG 1g.10gb"

    def nvmlDeviceGetPciInfo(self, h):
        if h.mig >= 0:  # MIG handles have no PCI function of their own
            raise self._error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        domain, rest = self.gpus[h.gpu].pci.split(":", 1)
        return SimpleNamespace(busId=f"0000{domain}:{rest}".upper().encode())

    def nvmlDeviceIsMigDeviceHandle(self, h):
        return ctypes.c_uint(1 if h.mig >= 0 else 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h):
        if h.mig < 0:
            raise self._error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(h.gpu)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        g = self.gpus[h.gpu]
        if not g.migs:
            raise self._error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g.mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, index):
        g = self.gpus[h.gpu]
        if index >= len(g.migs):
            raise self._error(pynvml.NVML_ERROR_NOT_FOUND)
        return _Handle(h.gpu, index)
