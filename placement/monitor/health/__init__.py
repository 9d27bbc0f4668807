"""A rank's health beside its steps: its own hang (hang.py: a rank that completes no step for
its hang limit names where its main thread waits), rank 0's watch over its peers' liveness
(peers.py), and where its memory pages are (residence.py). Log words are unchanged: the hang
events are `stall` events."""
from placement.monitor.health.hang import HangWatch
from placement.monitor.health.peers import PeerLiveness, PeerWatch
from placement.monitor.health.residence import ResidenceWatch

__all__ = ["HangWatch", "PeerLiveness", "PeerWatch", "ResidenceWatch"]
