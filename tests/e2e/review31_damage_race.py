#!/usr/bin/env python3
"""Review 31, F1 with the real daemon: a damaged dirty sector makes every ring hit on it take
the completion thread's fallback `Volume::read`; a second client writes across that line and
the next one. Once the completion thread and a writer wait for each other, both clients stop
getting replies.

Usage: review31_damage_race.py SOCKET LINE_SIZE LINE SECONDS
Prints "stalled after N rounds" (exit 0) if no reply came for 10 s, or "no stall in N rounds".
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import struct
from nbd_raw import CMD_READ, Conn, Fail, recv_exact  # noqa: E402

CMD_WRITE = 1


def main():
    path, line, l, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    a, b = Conn(path), Conn(path)
    last = [time.monotonic()]
    rounds = [0]
    errors = [0]
    stop = [False]
    damaged = l * line  # the first sector of line l (the writer writes its last)
    other = (l + 1) * line + 8 * 4096  # a sector of line l + 1

    def reader():
        while not stop[0]:
            h1 = a.request(CMD_READ, damaged, 4096)
            h2 = a.request(CMD_READ, other, 4096)
            # Either order; EIO (damaged dirty data) has no payload.
            for _ in range(2):
                magic, err, rh = struct.unpack(">IIQ", recv_exact(a.s, 16))
                if rh not in (h1, h2):
                    raise Fail("unexpected handle %d" % rh)
                if err == 0:
                    recv_exact(a.s, 4096)
                elif rh == h1:
                    errors[0] += 1
            rounds[0] += 1
            last[0] = time.monotonic()

    def writer():
        v = 0
        while not stop[0]:
            v += 1
            h = b.request(CMD_WRITE, (l + 1) * line - 4096, 8192, payload=bytes([v & 0xFF]) * 8192)
            b.reply(h)
            last[0] = time.monotonic()

    for t in (threading.Thread(target=reader, daemon=True), threading.Thread(target=writer, daemon=True)):
        t.start()
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        time.sleep(0.5)
        if time.monotonic() - last[0] > 10:
            print("stalled after %d rounds (%d EIO on the damaged sector) (%.0f s)" % (rounds[0], errors[0], time.monotonic() - start), flush=True)
            os._exit(0)
    stop[0] = True
    print("no stall in %d rounds (%d EIO on the damaged sector)" % (rounds[0], errors[0]), flush=True)
    os._exit(0)


main()
