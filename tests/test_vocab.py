"""The closed vocabularies are Enums, found by importing the code that uses them."""
from __future__ import annotations

import dis
import importlib
import json
import pkgutil
import types


import placement
from placement.config import PlacementConfig, load_config
from placement.events import EventKind, EventLog
from placement.plan.make import make_plan
from placement.plan.model import JobSpec, Plan, Shortfall
from placement.plan.table import warnings_summary
from placement.report.plot import MARKS
from placement.report.text import SHOWN_EVENTS
from placement.report.trace import TRACED_EVENTS
from placement.roles import ThreadRole
from placement.records.step import RoleSample, StepRecord
from placement.tune.window import summarize
from plan_topos import synth

# Modules that need what this machine may lack (a GPU job, an optional framework): read, not run.
_OPTIONAL = ("placement.integrations.lightning", "placement.integrations.transformers", "placement._worker_hook")


def _modules() -> list[types.ModuleType]:
    out = []
    for info in pkgutil.walk_packages(placement.__path__, "placement."):
        if info.name.startswith(_OPTIONAL) or info.name.endswith("__main__"):
            continue
        out.append(importlib.import_module(info.name))
    return out


def _code_objects(module: types.ModuleType):
    seen, todo = set(), []
    for value in vars(module).values():
        for obj in (value, *vars(value).values()) if isinstance(value, type) else (value,):
            obj = getattr(obj, "__func__", obj)
            code = getattr(obj, "__code__", None)
            if code is not None and getattr(obj, "__module__", None) == module.__name__:
                todo.append(code)
    while todo:
        code = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        yield code
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def _event_calls(code: types.CodeType):
    """(what names the kind, the constant or attribute) of every `<x>.event(...)`/`._event(...)`
    call in `code`: the instruction after the method load is the first argument."""
    ins = list(dis.get_instructions(code))
    for i, op in enumerate(ins[:-2]):
        if op.opname in ("LOAD_METHOD", "LOAD_ATTR") and op.argval in ("event", "_event"):
            nxt = ins[i + 1]
            if nxt.opname == "LOAD_CONST":
                yield ("const", nxt.argval)
            elif nxt.opname in ("LOAD_GLOBAL", "LOAD_NAME") and nxt.argval == "EventKind":
                yield ("member", ins[i + 2].argval)


def test_every_event_the_code_writes_names_an_event_kind_member():
    calls = [(m.__name__, code.co_name, how, what) for m in _modules() for code in _code_objects(m)
             for how, what in _event_calls(code)]
    assert len({c[0] for c in calls}) >= 8, calls  # the binder, stage 1, attach, monitor, tuner, ...: found
    literal = [c for c in calls if c[2] == "const"]
    assert not literal, f"event kinds written as text: {literal}"
    unknown = [c for c in calls if c[2] == "member" and c[3] not in EventKind.__members__]
    assert not unknown, unknown


def test_what_the_report_reads_are_event_kinds():
    for kind in (*SHOWN_EVENTS, *TRACED_EVENTS, *MARKS):
        assert EventKind(kind).value == kind


def test_an_event_line_reads_as_before(tmp_path):
    log = EventLog(str(tmp_path / "rank0.jsonl"), rank=0)
    rec = log.event(EventKind.WARNING, message="m")
    log.close()
    line = json.loads((tmp_path / "rank0.jsonl").read_text())
    assert line["type"] == "warning" and type(line["type"]) is str and rec["type"] == "warning"
    assert (tmp_path / "rank0.jsonl").read_text().startswith('{"type":"warning",')


def test_step_record_roles_are_thread_roles_in_memory_and_names_in_json():
    rec = StepRecord(rank=0, step=3, t=1.0, step_ms=10.0, roles={ThreadRole.MAIN: RoleSample(threads=1, cpu_ms=8.0)})
    assert json.loads(rec.to_json())["roles"].keys() == {"main"}
    assert rec.to_json() == json.dumps(rec.to_dict(), separators=(",", ":"))
    back = StepRecord.from_dict({**json.loads(rec.to_json()), "roles": {"main": {"threads": 1}, "later": {}}})
    assert list(back.roles) == [ThreadRole.MAIN] and isinstance(next(iter(back.roles)), ThreadRole)
    assert summarize([rec]).roles.keys() == {ThreadRole.MAIN}


def test_a_plan_that_ran_short_says_so_in_a_typed_field(tmp_path):
    topo = synth(packages=2)
    every = ",".join(str(c.id) for c in topo.cpus)
    plan = make_plan(topo, JobSpec(nproc_per_node=2), load_config([f"placement.reserved_cpus={every}"]))
    assert isinstance(plan.shortfall, Shortfall) and "no binding at all" in plan.shortfall.given_up
    assert plan.shortfall.warning() in plan.warnings
    assert warnings_summary(plan, "the log").startswith(plan.shortfall.warning())
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).shortfall == plan.shortfall
    whole = make_plan(topo, JobSpec(nproc_per_node=2), PlacementConfig())
    assert whole.shortfall is None and "shortfall" not in whole.to_dict()
