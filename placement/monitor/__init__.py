"""The per-rank step monitor, room by room along its data path (docs/design.md, "The monitor"):

    step_monitor.py   StepMonitor: the hand-over between the objects below, the monitor thread,
                      the lifecycle; hook.py: the step hook (training thread); build.py: raw
                      steps into records; watch.py: data wait; exitflush.py: every record
                      written at exit
    probes/           what is read of the rank's threads, how often, and what placement costs
    comm/             how long each step spent in collectives
    sinks/            where built records go (Delivery: the log, observers, summaries, digests)
    stragglers/       pure judgement of an exchange window: who is late, why, what it costs
    crossrank/        the c10d store: windows to rank 0 (duty.py: this rank's part), rank 0's
                      judgements and peer liveness
    health/           a rank's own hang, its peers' liveness, memory residence (rank.py: all three)
The log's schema is placement/records/, shared with `placement report`."""
