"""What a worker's environment makes of NCCL collective timing and of the flight recorder's
ring, and what placement sets there before torch reads it (placement.monitor.nccl_timing).

Upstream (torch 2.13, include/torch/csrc/distributed/c10d/):
- ProcessGroupNCCL records a start CUDA event per collective only with timing on
  (TORCH_NCCL_ENABLE_TIMING, or NCCL_ENABLE_TIMING, ProcessGroupNCCL.hpp:88-94; read in the
  group's constructor), and desync debug forces it: `desyncDebug_ = TORCH_NCCL_DESYNC_DEBUG ||
  dist_debug_level_ >= DebugLevel::Detail` and `enableTiming_ = TORCH_NCCL_ENABLE_TIMING ||
  desyncDebug_` (ProcessGroupNCCL.cpp constructor), so TORCH_DISTRIBUTED_DEBUG=DETAIL turns it
  on too. Without the start event retire_id writes no duration (FlightRecorderDetail.hpp:300-316).
- The cost of timing: one more cudaEventRecord per collective on the NCCL stream, and events
  created with timing (not cudaEventDisableTiming). With CUDA_DEVICE_MAX_CONNECTIONS=1 (one
  hardware queue, which Megatron-LM sets for tensor-parallel communication overlap) such events
  serialize the NCCL kernel with the GEMMs around it and break the overlap
  (pytorch/pytorch#143890, NVIDIA/TransformerEngine#1353, PaddlePaddle/Paddle#57574): `auto`
  leaves timing off there.
- The ring: TORCH_FR_BUFFER_SIZE, falling back to TORCH_NCCL_TRACE_BUFFER_SIZE, default 2000
  (FlightRecorder.hpp:110-111), read once when the recorder singleton is made (the first
  ProcessGroupNCCL). A Megatron step with TP=8 and sequence parallelism issues thousands of
  collectives, so 2000 wraps within a step; placement asks for PLACEMENT_RING when the user set
  neither variable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from placement.config import NcclTimingMode

TIMING_VAR = "TORCH_NCCL_ENABLE_TIMING"
TIMING_VARS = (TIMING_VAR, "NCCL_ENABLE_TIMING")  # ProcessGroupNCCL.hpp:88-94
DESYNC_VARS = ("TORCH_NCCL_DESYNC_DEBUG", "NCCL_DESYNC_DEBUG")
MAX_CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
RING_VAR = "TORCH_FR_BUFFER_SIZE"  # the one torch reads first (FlightRecorder.hpp:110-111)
# Holds three steps of a TP=8 sequence-parallel Megatron step (~3,000 collectives) between polls.
PLACEMENT_RING = 10000


# c10d's getCvarBool (torch/csrc/distributed/c10d/Utils.hpp:151-189, the same in torch 2.11.0
# and 2.13): the value lower-cased, not stripped, must be one of these words; any other value of
# any variable of the list makes it raise "Invalid value for environment variable".
CVAR_TRUE = ("y", "yes", "1", "t", "true")
CVAR_FALSE = ("n", "no", "0", "f", "false")


def cvar_bool(environ: Mapping[str, str], names: tuple[str, ...], default: bool = False) -> bool:
    """What c10d's getCvarBool reads from `names` (one setting and its older aliases): it parses
    the list in reverse, each variable set overwriting, so the first one set wins. ValueError,
    naming the variable, for a value it refuses (torch then raises where it reads it: a
    ProcessGroupNCCL constructor, which makes no group)."""
    value = default
    for name in reversed(names):
        raw = environ.get(name)
        if raw is None:
            continue
        word = raw.lower()
        if word not in CVAR_TRUE + CVAR_FALSE:
            raise ValueError(f"{name}={raw!r}: c10d reads only {'/'.join(CVAR_TRUE)} or {'/'.join(CVAR_FALSE)}")
        value = word in CVAR_TRUE
    return value


def timing_enabled_by_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ProcessGroupNCCL turns collective timing on from this environment (its
    constructor: enableTiming_ = getCvarBool(TORCH_NCCL_ENABLE_TIMING) || desyncDebug, desyncDebug
    = getCvarBool(TORCH_NCCL_DESYNC_DEBUG) || TORCH_DISTRIBUTED_DEBUG=DETAIL). False where
    torch would refuse a value: then it makes no NCCL group at all."""
    try:
        desync, timing = cvar_bool(environ, DESYNC_VARS), cvar_bool(environ, TIMING_VARS)
    except ValueError:
        return False
    # c10d/debug.cpp loadDebugLevelFromEnvironment: upper-cased, not stripped.
    return timing or desync or environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


@dataclass(frozen=True)
class NcclEnvDecision:
    """What placement sets for NCCL timing and the ring, and the one line that says why."""

    env: dict = field(default_factory=dict)  # variables to set
    timing_on: bool = False  # whether timing will be on once `env` is set
    note: Optional[str] = None  # one line for the log when timing stays off or cannot be set


def decide_nccl_env(mode: NcclTimingMode, environ: Mapping[str, str], *, process_group_exists: bool = False
                    ) -> NcclEnvDecision:
    """A user's explicit setting always wins: any timing variable set (to anything, even a value
    torch refuses) is left as it is, and so is either ring variable."""
    env: dict = {}
    if not any(k in environ for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        env[RING_VAR] = str(PLACEMENT_RING)
    try:
        cvar_bool(environ, TIMING_VARS), cvar_bool(environ, DESYNC_VARS)
    except ValueError as e:  # left as it is: the user's to fix
        return NcclEnvDecision(env, False, f"{e}; ProcessGroupNCCL refuses it and makes no NCCL group")
    if any(k in environ for k in TIMING_VARS):
        on = timing_enabled_by_env(environ)
        return NcclEnvDecision(env, on, None if on else f"{TIMING_VAR} is set off by the user: NCCL comm time is null")
    if timing_enabled_by_env(environ):  # desync debug or TORCH_DISTRIBUTED_DEBUG=DETAIL already force it
        return NcclEnvDecision(env, True)
    if mode is NcclTimingMode.OFF:
        return NcclEnvDecision(env, False, "placement.monitor.nccl_timing=off: NCCL comm time is null")
    if mode is NcclTimingMode.AUTO and environ.get(MAX_CONNECTIONS_VAR, "").strip() == "1":
        return NcclEnvDecision(env, False, (
            f"{MAX_CONNECTIONS_VAR}=1: collective timing left off, since its CUDA events would serialize NCCL with "
            "compute and break their overlap (pytorch/pytorch#143890); NCCL comm time is null "
            "(placement.monitor.nccl_timing=on turns it on anyway)"))
    if process_group_exists:
        return NcclEnvDecision({}, False, (
            f"attach() ran after init_process_group: set {TIMING_VAR}=1 before it (or launch with placerun) "
            "for NCCL comm time; until then it is null"))
    env[TIMING_VAR] = "1"
    return NcclEnvDecision(env, True)
