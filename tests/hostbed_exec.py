"""Run a program as a host of tests/hostbed.py: set the hostname (inside the new UTS namespace
that `unshare --uts` made for it), then exec the program.

    hostbed_exec.py HOSTNAME PROG [ARGS...]
"""
import os
import socket
import sys

if __name__ == "__main__":
    socket.sethostname(sys.argv[1])
    os.execvp(sys.argv[2], sys.argv[2:])
