"""A rank's communication time per step, behind one interface (base.CommTiming): collective calls
timed by wall time (gloo), NCCL's durations from PyTorch's own records (nccl.py, flight_recorder.py),
the process groups and their backends (groups.py); timing.py chooses the source and how DDP's
bucket all-reduces are seen (the flight recorder, or a comm hook)."""
from placement.monitor.comm.base import CommStep, CommTiming, OriginalCollectives
from placement.monitor.comm.timing import ONE_RANK_LINE, DdpBuckets, ddp_bucket_route, install_ddp_hook, make_comm_timing

__all__ = ["CommStep", "CommTiming", "DdpBuckets", "ONE_RANK_LINE", "OriginalCollectives", "ddp_bucket_route",
           "install_ddp_hook", "make_comm_timing"]
