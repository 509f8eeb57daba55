#!/usr/bin/env python3
"""Review 31, F3: a client that stops reading its replies holds up other clients.

Usage: review31_stall.py SOCKET LINE_SIZE N OP   (OP: read or write)

Client A sends N reads of one line each (lines 0..N-1, cached) and never reads a reply.
After 1 s, client B reads or writes 4 KiB of line N-1 (one of A's hits); prints the
time it took, e.g. "B read 0.001 s".
"""
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_raw import CMD_READ, REQUEST_MAGIC, Conn  # noqa: E402

CMD_WRITE = 1


def main():
    path, line, n, op = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    a = Conn(path)
    a.s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reqs = b"".join(
        struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_READ, i + 1, i * line, line) for i in range(n)
    )
    a.s.sendall(reqs)
    print("A sent %d reads and reads no reply" % n, flush=True)
    time.sleep(1)
    b = Conn(path)
    target = (n - 1) * line
    t = time.monotonic()
    if op == "read":
        h = b.request(CMD_READ, target, 4096)
        err, _ = b.reply(h, 4096)
    else:
        h = b.request(CMD_WRITE, target, 4096, payload=b"\x05" * 4096)
        err, _ = b.reply(h)
    print("B %s %.3f s (error %d)" % (op, time.monotonic() - t, err), flush=True)
    a.s.close()
    b.s.close()


main()
