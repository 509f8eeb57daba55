#!/usr/bin/env python3
"""NBD clients that misbehave on purpose, for the tests of serve's limits and stop.

Usage: nbd_stall.py SOCKET CASE [ARGS...]

Cases:
  noread N LEN [OFFSET]  open a session, send N reads of LEN bytes at OFFSET (default 0) and
                         never read a reply; print "stalled" and sleep until killed (at most
                         300 s). The server's replies fill the socket and a worker blocks.
  reads N LEN            one session, N reads of LEN bytes pipelined, then every reply read;
                         prints "done N"
  sessions N             open N sessions one after the other and keep them open; print
                         "opened K refused M" (a refused session is closed before the
                         greeting), then "holding" and sleep until killed (at most 300 s)
Exit status 0 on success, 1 with a message on a failed expectation.
"""

import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nbd_raw import CMD_READ, REQUEST_MAGIC, Conn, Fail, recv_exact  # noqa: E402

MAX_SLEEP = 300


def send_reads(conn, n, length, offset):
    # One send: many small ones cost a socket buffer's worth of overhead and would block
    # once the server stops reading.
    requests = b"".join(
        struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_READ, i + 1, offset, length) for i in range(n)
    )
    conn.s.sendall(requests)


def case_noread(path, n, length, offset=0):
    conn = Conn(path)
    send_reads(conn, int(n), int(length), int(offset))
    print("stalled", flush=True)
    time.sleep(MAX_SLEEP)


def case_reads(path, n, length):
    n, length = int(n), int(length)
    conn = Conn(path)
    send_reads(conn, n, length, 0)
    for _ in range(n):
        magic, err, _handle = struct.unpack(">IIQ", recv_exact(conn.s, 16))
        if err != 0:
            raise Fail("read failed with error %d" % err)
        recv_exact(conn.s, length)
    conn.close()
    print("done %d" % n, flush=True)


def greeted(path):
    """A session that got through the handshake, or None if closed before the greeting."""
    try:
        return Conn(path)
    except Fail as e:
        if "closed the connection" in str(e):
            return None
        raise


def case_sessions(path, n):
    held, refused = [], 0
    for _ in range(int(n)):
        conn = greeted(path)
        if conn is None:
            refused += 1
        else:
            held.append(conn)
    print("opened %d refused %d" % (len(held), refused), flush=True)
    print("holding", flush=True)
    time.sleep(MAX_SLEEP)


CASES = {"noread": case_noread, "reads": case_reads, "sessions": case_sessions}


def main():
    if len(sys.argv) < 3 or sys.argv[2] not in CASES:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        CASES[sys.argv[2]](sys.argv[1], *sys.argv[3:])
    except (Fail, OSError) as e:
        print("FAIL: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
