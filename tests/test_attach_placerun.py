"""Under placerun, attach() joins the Session stage 1 made: one log per rank holding the
bootstrap's bind events and the monitor's records, the plan's `main` core read back from
/proc, and keyword overrides of binding keys dropped with one stderr line per rank naming them
(placerun decided them).

The file is also the training script placerun runs.
"""
import json
import os
import sys

import pytest

from placement.records.step import line_steps
from placerun_helpers import run_self_under_placerun, write_facts

STEPS = 12


@pytest.mark.slow
def test_placerun_two_ranks_attach_joins_the_session(tmp_path):
    logs = tmp_path / "logs"
    p = run_self_under_placerun(__file__, tmp_path)
    for rank in (0, 1):  # attach(policy="none") under placerun: one line per rank, the key named
        said = [line for line in p.stderr.splitlines() if f"placement: rank {rank}: placerun's plan wins" in line]
        assert len(said) == 1 and "attach() settings dropped: placement.policy='none'" in said[0], p.stderr[-4000:]
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts{rank}.json").read_text())
        assert facts["used_session"] and facts["policy_kept"] == "auto"
        assert facts["main_allowed"] == facts["plan_main"]
        lines = [json.loads(l) for l in (logs / f"rank{rank}.jsonl").read_text().splitlines()]
        kinds = [l["type"] for l in lines]
        assert kinds[0] == "start" and "bind" in kinds  # stage 1 wrote these ...
        steps = [l for l in lines if l["type"] == "step"]  # ... and the monitor its records, same file
        assert [n for s in steps for n in line_steps(s)] == list(range(1, STEPS + 1))  # (several a record, or one)
        assert all(s["comm_count"] >= 1 for s in steps)
        assert all(set(s["roles"]["main"]["cpus"]) <= set(facts["plan_main"]) for s in steps)


def script(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import placement
    from placement.cpuset import parse_cpulist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    h = placement.attach(model, opt, policy="none", monitor={"exchange_every": 4, "flush_every": 4})
    for _ in range(STEPS):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    with open(f"/proc/self/task/{os.getpid()}/status") as f:
        allowed = parse_cpulist(next(l for l in f if l.startswith("Cpus_allowed_list")).split(":", 1)[1])
    main = next(a for r, a in h.rank_plan.roles.items() if r.value == "main")
    facts = {"used_session": h.session is not None and not h._owns_session, "policy_kept": h.config.policy,
             "plan_main": sorted(main.cpus), "main_allowed": sorted(allowed)}
    h.close()
    write_facts(out_dir, rank, facts)
    dist.destroy_process_group()


if __name__ == "__main__":
    script(sys.argv[1])
