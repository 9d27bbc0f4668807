"""Where built step records go, in order (base.py): the rank's JSONL log (jsonl.py), observers (the
tuner), the exchange window, the periodic summary, digests, TensorBoard (tensorboard.py). One
failing sink does not stop the others."""
from placement.monitor.sinks.base import Delivery, RecordSink, close_sinks, write_to_sinks

__all__ = ["Delivery", "RecordSink", "close_sinks", "write_to_sinks"]
