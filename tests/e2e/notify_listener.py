#!/usr/bin/env python3
"""Stands in for systemd's notify socket (sd_notify): binds a Unix datagram socket at PATH
and appends every message it receives to OUT, one line per message (its newlines shown as
'|'), until SECONDS have passed. Usage: notify_listener.py PATH OUT SECONDS"""
import os
import socket
import sys
import time

path, out, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
if os.path.exists(path):
    os.unlink(path)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
sock.bind(path)
deadline = time.monotonic() + seconds
with open(out, "a", buffering=1) as log:
    log.write("LISTENING\n")
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(min(left, 1.0))
        try:
            data = sock.recv(4096)
        except socket.timeout:
            continue
        log.write(data.decode("utf-8", "replace").replace("\n", "|") + "\n")
