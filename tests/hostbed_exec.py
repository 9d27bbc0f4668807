"""Run a program as a host of tests/hostbed.py: set the hostname (inside the new UTS namespace
that `unshare --uts` made for it), keep it to the host's CPUs when the bed gave it some (as a
host's own cores: sched_setaffinity, inherited by everything the program starts), then exec it.

    hostbed_exec.py [--cpus LIST] HOSTNAME PROG [ARGS...]      (LIST: 0,2-3)
"""
import os
import socket
import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "--cpus":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from placement.cpuset import parse_cpulist

        os.sched_setaffinity(0, parse_cpulist(args[1]))
        args = args[2:]
    socket.sethostname(args[0])
    os.execvp(args[1], args[1:])
