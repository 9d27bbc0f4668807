"""A rank's health beside its steps: its own hang (a rank that completes no step for the hang
limit gets an event naming where its main thread waits), rank 0's watch over its peers'
liveness (hang.py), and where its memory pages are (residence.py). Log words are unchanged:
the events are `stall` events."""
from placement.monitor.health.hang import PeerWatch, HangWatch
from placement.monitor.health.residence import ResidenceWatch

__all__ = ["PeerWatch", "ResidenceWatch", "HangWatch"]
