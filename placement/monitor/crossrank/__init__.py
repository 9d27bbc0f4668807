"""The only monitor code that talks to the job's c10d store: each rank's window figures to rank 0
every monitor.exchange_every steps and its judgement handed back (stragglers/), and the hang
posts and rows rank 0's peer watch reads (health/peers.py)."""
from placement.monitor.crossrank.exchange import Exchange, default_store, exchange_steps

__all__ = ["Exchange", "default_store", "exchange_steps"]
