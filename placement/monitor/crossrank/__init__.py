"""The only monitor code that talks to the job's c10d store: each rank's window figures to rank 0
every monitor.exchange_every steps, rank 0's judgement of them (stragglers/), and what rank 0 learns
of its peers' liveness from their rows and posts (health/hang.py's PeerWatch reads it)."""
from placement.monitor.crossrank.exchange import Exchange, default_store, exchange_steps

__all__ = ["Exchange", "default_store", "exchange_steps"]
