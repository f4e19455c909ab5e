#!/usr/bin/env python3
"""Asks a running QEMU, through its human monitor on a UNIX socket, where
its vCPUs are (`info status`, `info cpus`, `info registers -a`) and prints
the answers: scripts/nested-test.sh runs it just before it gives up on a
hung nested run, so the log says whether L1 was running, halted or stuck
(docs/linux-guests.md).

  python3 scripts/qemu-monitor-dump.py SOCKET
"""
import re
import socket
import sys
import time

# The monitor echoes what it is sent with terminal editing sequences.
ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

COMMANDS = ["info status", "info cpus", "info registers -a"]


def read_for(s, seconds):
    s.settimeout(0.2)
    out = b""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: qemu-monitor-dump.py SOCKET")
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sys.argv[1])
    except OSError as e:
        print(f"qemu-monitor-dump: cannot reach the monitor at {sys.argv[1]}: {e}")
        return
    read_for(s, 1.0)  # the banner
    for c in COMMANDS:
        s.sendall(c.encode() + b"\n")
        print(f"== {c}")
        lines = ESCAPES.sub("", read_for(s, 3.0)).replace("\r", "").splitlines()
        # The first line is the echo of the command, the last the prompt.
        print("\n".join(line for line in lines if not line.startswith("(qemu)") and c not in line))
    s.close()


if __name__ == "__main__":
    main()
