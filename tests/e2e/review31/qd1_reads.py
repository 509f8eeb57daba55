#!/usr/bin/env python3
"""QD1 reads for review 31, F5: read 4 KiB at OFFSET1 and wait up to 10 s for the reply; if it
does not come, read 4 KiB at OFFSET2 and see whether both replies come then.
Usage: qd1_reads.py SOCKET OFFSET1 OFFSET2"""
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nbd_raw import CMD_READ, Conn, recv_exact  # noqa: E402

path, o1, o2 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = Conn(path)
c.s.settimeout(10)
t = time.monotonic()
c.request(CMD_READ, o1, 4096)
try:
    magic, err, h = struct.unpack(">IIQ", recv_exact(c.s, 16))
    recv_exact(c.s, 4096)
    print("first read answered in %.3f s" % (time.monotonic() - t))
    sys.exit(0)
except socket.timeout:
    print("first read: no reply in 10 s", flush=True)
c.request(CMD_READ, o2, 4096)
got = []
for _ in range(2):
    magic, err, h = struct.unpack(">IIQ", recv_exact(c.s, 16))
    if err == 0:
        recv_exact(c.s, 4096)
    got.append(h)
print("after a second read, replies for handles %s" % sorted(got))
sys.exit(1)
