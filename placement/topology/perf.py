"""Single-thread performance evidence of each CPU and the `perf_rank` built from it.

Evidence, strongest first: ACPI CPPC `highest_perf` (cpuN/acpi_cppc), the amd-pstate preferred-core
ranking, cpufreq `cpuinfo_max_freq`, cpufreq `base_frequency` (SST-BF high-priority cores show a
higher one).

cpufreq evidence belongs to a frequency policy, which several CPUs may share. Kernels normally give
every CPU of a policy a `cpufreq` link to it, but some (seen on an ARM board) give the directory to
the policy's first CPU only, whose `related_cpus` names the others; cpu/cpufreq/policyN/ may hold
it too. A CPU without cpufreq evidence of its own takes its policy's.

Where we differ from hwloc on purpose (hwloc/topology-linux.c, `look_sysfscpukinds_by_freq` and
`hwloc_linux_cpukinds_adjust_maxfreqs`): hwloc reads each CPU's own cpufreq directory only, and
when the max frequencies of CPUs with one base frequency differ by less than 10% it evens them out
(Turbo Boost 3.0 "favoured cores" are then not a CPU kind of their own). We keep them apart: the
favoured cores are exactly where the rank's main thread should run.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from placement.topology._sysfs import CPU_DIR, SysfsReader

POLICY_DIR = f"{CPU_DIR}/cpufreq"


@dataclass(frozen=True)
class PerfEvidence:
    """Single-thread peak evidence of one CPU, strongest first (see perf_ranks)."""

    highest_perf: Optional[int]  # ACPI CPPC
    prefcore_ranking: Optional[int]  # amd-pstate preferred-core ranking
    max_khz: Optional[int]  # cpufreq cpuinfo_max_freq
    base_khz: Optional[int]  # cpufreq base_frequency

    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


@dataclass(frozen=True)
class _FreqEvidence:
    prefcore_ranking: Optional[int]
    max_khz: Optional[int]
    base_khz: Optional[int]


_NO_FREQ = _FreqEvidence(None, None, None)


def _freq_at(fs: SysfsReader, rel_dir: str) -> _FreqEvidence:
    def read(name: str) -> Optional[int]:
        return fs.integer(f"{rel_dir}/{name}") if fs.has(rel_dir, name) else None

    return _FreqEvidence(read("amd_pstate_prefcore_ranking"), read("cpuinfo_max_freq"), read("base_frequency"))


def _cpu_numbers(fs: SysfsReader, rel: str) -> frozenset[int]:
    """related_cpus / affected_cpus: CPU numbers separated by spaces (not a kernel cpu list)."""
    text = fs.text(rel)
    if not text:
        return frozenset()
    try:
        return frozenset(int(v) for v in text.split())
    except ValueError:
        fs.warn(rel, f"not a list of CPU numbers: {text[:40]!r}")
        return frozenset()


def _policy_dirs(fs: SysfsReader, own: dict[int, str]) -> list[str]:
    """Every cpufreq directory that may name other CPUs: cpu/cpufreq/policy*, then the CPUs' own."""
    policies = sorted(n for n in fs.listdir(POLICY_DIR) or () if n.startswith("policy"))
    return [f"{POLICY_DIR}/{n}" for n in policies] + [own[c] for c in sorted(own)]


def freq_evidence(fs: SysfsReader, online: frozenset[int]) -> dict[int, _FreqEvidence]:
    """cpufreq evidence per online CPU, from its own directory or else from its policy's."""
    own = {c: f"{CPU_DIR}/cpu{c}/cpufreq" for c in sorted(online) if fs.has(f"{CPU_DIR}/cpu{c}", "cpufreq")}
    out = {c: _freq_at(fs, d) for c, d in own.items()}
    missing = set(online) - set(out)
    if not missing:
        return out
    for d in _policy_dirs(fs, own):
        if not missing:
            break
        named = (_cpu_numbers(fs, f"{d}/related_cpus") | _cpu_numbers(fs, f"{d}/affected_cpus")) & missing
        if named:
            evidence = _freq_at(fs, d)
            for c in named:
                out[c] = evidence
            missing -= named
    for c in missing:
        out[c] = _NO_FREQ
    return out


def perf_evidence(fs: SysfsReader, online: frozenset[int]) -> dict[int, PerfEvidence]:
    freq = freq_evidence(fs, online)
    out = {}
    for cpu in sorted(online):
        d = f"{CPU_DIR}/cpu{cpu}"
        cppc = fs.integer(f"{d}/acpi_cppc/highest_perf") if fs.has(d, "acpi_cppc") else None
        f = freq[cpu]
        out[cpu] = PerfEvidence(cppc, f.prefcore_ranking, f.max_khz, f.base_khz)
    return out


def perf_ranks(evidence: dict[int, PerfEvidence]) -> dict[int, int]:
    """Dense rank by expected single-thread peak, 0 = fastest; equal evidence, equal rank.

    Evidence is compared in order (CPPC highest_perf, then prefcore ranking, then max, then base
    frequency); a kind no CPU reports is left out, a CPU missing a kind others report ranks below
    them on it. A CPU with no evidence at all ties with the fastest: the absence of evidence says
    nothing about its speed, so it is never ranked below one with evidence because of it.
    """
    known = {cpu: e for cpu, e in evidence.items() if e.any()}
    kinds = [f.name for f in fields(PerfEvidence) if any(getattr(e, f.name) is not None for e in known.values())]

    def score(e: PerfEvidence) -> tuple[int, ...]:
        return tuple(-1 if getattr(e, k) is None else getattr(e, k) for k in kinds)

    distinct = sorted({score(e) for e in known.values()}, reverse=True)
    rank = {s: i for i, s in enumerate(distinct)}
    return {cpu: rank[score(e)] if cpu in known else 0 for cpu, e in evidence.items()}
