"""The text of `placement report`: the per-rank table and the events, one concise line each."""
from __future__ import annotations

from typing import Any, Optional

from placement.cpuset import format_cpulist
from placement.records.words import cost_words
from placement.records.summary import RunSummary, summarize
from placement.report.logs import RunLog

HEADER = ("rank", "steps", "p50 ms", "p99 ms", "data %", "comm %", "CPU stall %", "compute %", "verdict (most steps)")
SHOWN_EVENTS = ("bind", "memory", "tune", "rollback", "straggler", "stall", "warning", "start", "end", "monitor", "lost")


def _f(v: Optional[float], digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def summaries(log: RunLog) -> list[RunSummary]:
    """One RunSummary per rank (the per-rank table: log.records, kept for a few ranks, or the
    ranks' digests)."""
    if log.from_digests:
        return [d.summary() for _, d in sorted(log.digests.items()) if d.steps]
    return [s for s in (summarize(rank, recs) for rank, recs in sorted((log.records or {}).items())) if s is not None]


def read_line(log: RunLog) -> str:
    """How the step records were read, when by their digests ('' otherwise)."""
    if not log.from_digests:
        return ""
    return (f"read by digests (monitor.digest_every steps each; percentiles within 1%): {log.step_count()} steps "
            + (f"from the event indexes of {log.indexed} log(s) (their step lines not read)"
               + (f" and {log.step_lines} step lines counted in the others" if log.step_lines else "")
               if log.indexed else
               f"of the {log.step_lines} step lines in these logs ({log.step_lines - log.step_count()} in no digest: "
               "a rank's last steps before its digest, or other runs)")
            + "; --read steps parses every line")


def rank_table(rows: list[RunSummary]) -> str:
    body = []
    for s in rows:
        top = max(s.verdicts.items(), key=lambda kv: kv[1])
        body.append((str(s.rank), str(s.steps), _f(s.p50_ms, 2), _f(s.p99_ms, 2), _f(s.data_pct), _f(s.comm_pct),
                     _f(s.stall_pct), _f(s.compute_pct), f"{top[0]} ({100 * top[1] // s.steps}%)"))
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.rjust(w) if i < 8 else h for i, (h, w) in enumerate(zip(HEADER, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(c.rjust(w) if i < 8 else c for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def _cpus(v: Any) -> str:
    try:
        return format_cpulist(v) or "-"
    except TypeError:
        return str(v)


def _bind_group(events: list[dict]) -> str:
    """Consecutive bind events of one rank: one line, role -> CPUs (thread count), failures named."""
    by_target: dict[tuple, int] = {}
    failed = []
    for e in events:
        key = (e.get("role") or "process", _cpus(e.get("planned", [])))
        threads = e.get("threads", 1)  # a DataLoader worker's threads are one event
        by_target[key] = by_target.get(key, 0) + (threads if isinstance(threads, int) else 1)
        if not e.get("ok", True):
            failed.append(f"{e.get('name')}/{e.get('tid')}: {e.get('error')}")
    parts = [f"{role}->{cpus}" + (f" x{n}" if n > 1 else "") for (role, cpus), n in by_target.items()]
    text = f"bind {len(events)} thread(s): " + ", ".join(parts)
    if failed:
        text += f"; FAILED {len(failed)}: " + "; ".join(failed[:3])
    return text


def _straggler(e: dict) -> str:
    steps = e.get("steps") or ["?", "?"]
    parts = []
    for s in e.get("stragglers", []):
        late = "" if s.get("lateness_ms") is None else f", late {s['lateness_ms']:.1f} ms/step"
        if s.get("steps_judged"):  # how steady: naming.py names a rank late at most of its steps sooner
            late += f"{' at' if late else ', late at'} {s.get('steps_late')} of {s['steps_judged']} steps"
        cost = cost_words(s.get("cost_ms_per_step"), s.get("cost_pct"), s.get("cost_by_cause"))
        since = f" (since step {s['since_step']})" if s.get("since_step") is not None else ""
        parts.append(f"rank(s) {s.get('ranks')} {s.get('kind')}{late}{since}: " + (f"{cost}; " if cost else "")
                     + str(s.get("why")))
    job = e.get("job_wide")
    if isinstance(job, dict):
        cost = cost_words(job.get("cost_ms_per_step"), job.get("cost_pct"),
                          {job.get("cause"): job.get("cost_ms_per_step") or 0.0})
        parts.append(f"job-wide {job.get('kind')}: " + (f"{cost}; " if cost else "") + str(job.get("why")))
    waiting = e.get("waiting") or []
    tail = f" | waiting for them: {waiting}" if waiting else ""
    return f"straggler steps {steps[0]}-{steps[-1]}: " + "; ".join(parts) + tail


def _generic(e: dict, limit: int = 160) -> str:
    fields = {k: v for k, v in e.items() if k not in ("type", "t", "rank", "run")}  # the run is said once, above
    msg = fields.pop("message", None)
    text = e["type"] + ((": " + str(msg)) if msg else "")
    if fields:
        text += " " + ", ".join(f"{k}={v}" for k, v in fields.items())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _describe(e: dict) -> str:
    kind = e.get("type")
    if kind == "straggler":
        return _straggler(e)
    if kind == "memory":
        planned = e.get("planned") or {}
        applied = e.get("applied") or {}
        return (f"memory planned {planned.get('mode')} {planned.get('nodes')} -> applied "
                f"{applied.get('mode')} {applied.get('nodes')}" + (f" ({e['fallback']})" if e.get("fallback") else "")
                + _resident_words(e.get("resident")))
    if kind == "end" and e.get("source") == "monitor":
        held = e.get("straggler_candidates_held_back")
        thread = e.get("monitor_thread_us_per_step")
        whole, pct = e.get("placement_cpu_us_per_step"), e.get("placement_cost_pct")
        return (f"monitor end after {e.get('steps')} steps, {e.get('monitor_us_per_step')} us/step in the step hook"
                + ("" if thread is None else f", {thread} us/step of CPU on its own thread")
                + ("" if whole is None else f"; placement in all {whole} us/step"
                   + ("" if pct is None else f", {pct}% of the step"))
                + (f"; hand-overs {e.get('handover_floor_s')} s apart at least (x{scale}: stretched to keep the budget)"
                   if isinstance(scale := e.get("handover_floor_scale"), int) and scale > 1 else "")
                + (f"; {held} straggler candidate(s) not named (cost under the threshold, or not in 2 windows in a row)"
                   if held else ""))
    if kind == "start" and e.get("source") == "monitor":
        return (f"monitor start: comm timing {e.get('comm_timing')} (backend {e.get('backend')}), "
                f"DDP hook {e.get('ddp_hook')}, exchange {e.get('exchange')}")
    if kind == "monitor":
        return f"monitor: {e.get('message')}"
    if kind == "lost":
        return f"LOST {e.get('records')} record(s) so far: {e.get('error')}"
    if kind == "start":
        return f"start pid {e.get('pid')} policy {e.get('policy')}"
    return _generic(e)


def _resident_words(r) -> str:
    """', resident 99.8% on [0] (move_pages)' from a residence dict (residence.py)."""
    if not isinstance(r, dict):
        return ""
    share = r.get("share_pct")
    where = f"{share}% on {r.get('planned')}" if share is not None else f"by node {r.get('by_node')}"
    return f", {r.get('what', 'process')} resident {where} ({r.get('source')})"


BIND_FOLD_S = 1.0  # bind events of one rank this close together are one line


def event_lines(log: RunLog) -> list[str]:
    """Events in time order; a rank's bind events within BIND_FOLD_S of each other (and not
    interrupted by another event of that rank) folded into one line."""
    t0 = log.t0()
    items: list = []
    open_binds: dict = {}
    for e in log.events:
        if e.get("type") not in SHOWN_EVENTS:
            continue
        rank = e.get("rank")
        t = e.get("t") if isinstance(e.get("t"), (int, float)) else t0
        if e["type"] != "bind":
            open_binds.pop(rank, None)
            items.append((t, rank, e))
            continue
        group = open_binds.get(rank)
        if group is not None and t - group[-1].get("t", t) <= BIND_FOLD_S:
            group.append(e)
            continue
        group = open_binds[rank] = [e]
        items.append((t, rank, group))
    out = []
    for t, rank, item in items:
        try:
            text = _bind_group(item) if isinstance(item, list) else _describe(item)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError):  # a field of an odd shape
            text = _generic(item[0] if isinstance(item, list) else item)
        out.append(f"{t - t0:8.2f}s rank {'?' if rank is None else rank}: {text}")
    return out


# The parts of a step, said once (records/parts.py); README.md says the same.
PARTS_SENTENCE = ("a step's time = data wait + comm wait + CPU stall (main's runqueue wait while computing) + "
                  "compute, disjoint, as % of step time: they add up to 100")


# What the report says of logs written before comm wait (records/parts.py).
IN_FLIGHT_LINE = ("comm here is comm in flight on {n} step line(s), written before placement measured comm wait: "
                  "it includes compute that overlapped the collectives, so compute is short by as much")


def run_lines(log: RunLog) -> list[str]:
    """What the logs hold beside the run reported: one line when they hold several runs (the
    run reported and how to choose another; 'of N jobs' when their launchers name different
    jobs), one per rank whose steps started over within the run."""
    out = []
    if len(log.runs) > 1 and log.run is not None:
        jobs = {r.job for r in log.runs if r.job}  # as the launchers name them (none: not known)
        of = f" of {len(jobs)} jobs" if len(jobs) > 1 else ""
        out.append(f"these logs hold {len(log.runs)} runs{of}: reporting run {log.run.describe()} "
                   f"(--run N|ID for another; --compare A B to put two side by side)")
        out.extend(f"  run {r.describe()}" for r in log.runs if r is not log.run)
    for rank, n in sorted(log.earlier_runs.items()):
        out.append(f"rank {rank}: its steps started over {n} time(s) in this run; the last start is reported")
    return out


def printable(text: str) -> str:
    """`text` with every control or format character but the newline escaped (\\x1b, \\u202e...):
    a log's strings are input, and one holding a terminal's escape codes would clear the screen,
    retitle it or hide lines when the report is printed."""
    if all(c == "\n" or c.isprintable() for c in text):
        return text
    return "".join(c if c == "\n" or c.isprintable() else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in text)


def report_text(log: RunLog) -> str:
    rows = summaries(log)
    parts = [f"placement report: {len(log.files)} file(s), {log.step_count()} step records, "
             f"{len(log.events)} events"]
    if log.from_digests:
        parts.append(read_line(log))
    if log.skipped:
        parts.append(f"skipped {log.skipped} truncated or corrupt line(s)")
    for path, why in log.unreadable:
        parts.append(f"skipped file {path}: {why}")
    if log.links_skipped:
        parts.append(f"skipped {log.links_skipped} link(s) in the directories read (not followed: a link can loop "
                     "or lead to another user's files; name a linked log to read it)")
    for rank, n in sorted(log.lost.items()):
        parts.append(f"rank {rank}: {n} record(s) were lost: its writer could not write them (see its `lost` event)")
    parts.extend(run_lines(log))
    parts.append("")
    parts.append(rank_table(rows) if rows else "no step records")
    parts.append("")
    parts.append(PARTS_SENTENCE)
    if log.comm_in_flight:
        parts.append(IN_FLIGHT_LINE.format(n=log.comm_in_flight))
    lines = event_lines(log)
    parts.append("")
    parts.append(f"events ({len(lines)}):" if lines else "events: none")
    parts.extend("  " + l for l in lines)
    return "\n".join(parts)
