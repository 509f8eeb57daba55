#!/usr/bin/env python3
"""Raw NBD client for ssdcache's e2e tests: sends malformed/out-of-range requests over a Unix socket.

Usage: nbd_raw.py SOCKET CASE [EXPORT]

Cases (each prints what it checked; exit 0 on success, 1 with a message on a failed expectation):
  handshake      fixed-newstyle handshake + NBD_OPT_GO; print size and flags
  read-past-end  read of 4096 bytes at the export size -> EINVAL
  write-past-end write of 4096 bytes at the export size (payload sent) -> ENOSPC
  misaligned     byte offsets and lengths are served: writes of 512, 1 and 4096 bytes at
                 offsets 0, 1023, 1024 and 4097 read back exactly, with their neighbours intact
  read-huge      read of 33 MiB -> an error, then a valid read on the same connection works
  write-huge     write of 33 MiB (payload sent) -> an error, then a valid read works
  other-cmds     trim/write-zeroes/cache past the end or misaligned, an unknown command -> errors
  read-only      on a --read-only export: write/trim/write-zeroes -> EPERM, reads work
  options        NBD_OPT_LIST, an unknown option (ERR_UNSUP, session continues), NBD_OPT_ABORT,
                 and the old NBD_OPT_EXPORT_NAME path followed by a read
  many-conns     64 connections open at once; a write on one is read back on every other one
  hold           open an idle session, a session stuck in a write payload and one stuck in the
                 handshake, print "holding", then sleep 120 s (for stop-under-load tests)
  garbage        garbage instead of the client flags / options -> the server closes the connection
  disconnect-mid-write  write header for 1 MiB, half the payload, then hang up
  all            every case above except 'handshake', 'read-only' and 'hold'
Only the simple-reply protocol is used (structured replies are never requested).
"""

import errno
import os
import socket
import struct
import sys

NBDMAGIC = b"NBDMAGIC"
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF

FLAG_FIXED_NEWSTYLE = 1
FLAG_NO_ZEROES = 2
OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_GO = 7
REP_SERVER = 2
REP_ERR_UNSUP = 0x80000001
REP_ACK = 1
REP_INFO = 3
INFO_EXPORT = 0
INFO_BLOCK_SIZE = 3
CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6

MiB = 1 << 20
TIMEOUT = 30.0


class Fail(Exception):
    pass


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise Fail("server closed the connection (wanted %d more bytes)" % (n - len(buf)))
        buf += chunk
    return bytes(buf)


def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT)
    s.connect(path)
    return s


class Conn:
    def __init__(self, path, export=""):
        self.s = connect(path)
        self.handle = 0
        magic = recv_exact(self.s, 8)
        if magic != NBDMAGIC:
            raise Fail("bad greeting magic %r" % magic)
        (opt_magic,) = struct.unpack(">Q", recv_exact(self.s, 8))
        if opt_magic != IHAVEOPT:
            raise Fail("server is not newstyle (magic %x)" % opt_magic)
        (hflags,) = struct.unpack(">H", recv_exact(self.s, 2))
        if not hflags & FLAG_FIXED_NEWSTYLE:
            raise Fail("server does not offer fixed newstyle (flags %x)" % hflags)
        cflags = FLAG_FIXED_NEWSTYLE | (FLAG_NO_ZEROES if hflags & FLAG_NO_ZEROES else 0)
        self.s.sendall(struct.pack(">I", cflags))
        name = export.encode()
        data = struct.pack(">I", len(name)) + name + struct.pack(">HH", 1, INFO_BLOCK_SIZE)
        self.s.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
        self.size = None
        self.flags = None
        self.block = None
        while True:
            magic, opt, rtype, rlen = struct.unpack(">QIII", recv_exact(self.s, 20))
            if magic != OPT_REPLY_MAGIC or opt != OPT_GO:
                raise Fail("bad option reply magic %x opt %d" % (magic, opt))
            payload = recv_exact(self.s, rlen)
            if rtype == REP_ACK:
                break
            if rtype & 0x80000000:
                raise Fail("NBD_OPT_GO refused: reply type %x %r" % (rtype, payload))
            if rtype == REP_INFO and len(payload) >= 2:
                (itype,) = struct.unpack(">H", payload[:2])
                if itype == INFO_EXPORT:
                    self.size, self.flags = struct.unpack(">QH", payload[2:12])
                elif itype == INFO_BLOCK_SIZE:
                    self.block = struct.unpack(">III", payload[2:14])
        if self.size is None:
            raise Fail("no NBD_INFO_EXPORT before NBD_REP_ACK")

    def request(self, cmd, offset, length, payload=None, flags=0):
        self.handle += 1
        h = self.handle
        self.s.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, h, offset, length))
        if payload is not None:
            self.s.sendall(payload)
        return h

    def reply(self, h, read_len=0):
        magic, err, rh = struct.unpack(">IIQ", recv_exact(self.s, 16))
        if magic == STRUCTURED_REPLY_MAGIC:
            raise Fail("structured reply although none was negotiated")
        if magic != SIMPLE_REPLY_MAGIC:
            raise Fail("bad reply magic %x" % magic)
        if rh != h:
            raise Fail("reply handle %d, expected %d" % (rh, h))
        data = b""
        if err == 0 and read_len:
            data = recv_exact(self.s, read_len)
        return err, data

    def read(self, offset, length):
        return self.reply(self.request(CMD_READ, offset, length), length)

    def write(self, offset, data):
        return self.reply(self.request(CMD_WRITE, offset, len(data), data))

    def close(self):
        try:
            self.s.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_DISC, 0, 0, 0))
        except OSError:
            pass
        self.s.close()


def ename(e):
    return "%d (%s)" % (e, errno.errorcode.get(e, "?"))


def expect_err(what, got, want):
    if isinstance(want, int):
        ok = got == want
        wdesc = ename(want)
    elif isinstance(want, tuple):
        ok = got in want
        wdesc = " or ".join(ename(w) for w in want)
    else:  # any error
        ok = got != 0
        wdesc = "any error"
    if not ok:
        raise Fail("%s: got error %s, expected %s" % (what, ename(got), wdesc))
    print("ok: %s -> error %s" % (what, ename(got)))


def check_usable(c, what):
    """A valid read and write on the same connection after an error."""
    pattern = os.urandom(4096)
    err, _ = c.write(8192, pattern)
    if err:
        raise Fail("after %s: valid write failed with %s" % (what, ename(err)))
    err, data = c.read(8192, 4096)
    if err:
        raise Fail("after %s: valid read failed with %s" % (what, ename(err)))
    if data != pattern:
        raise Fail("after %s: read back different data" % what)
    print("ok: connection still usable after %s" % what)


def case_handshake(path, export):
    c = Conn(path, export)
    print("size=%d flags=0x%x block=%s" % (c.size, c.flags, c.block))
    c.close()


def case_read_past_end(path, export):
    c = Conn(path, export)
    expect_err("read 4096 at size", c.read(c.size, 4096)[0], errno.EINVAL)
    expect_err("read 8192 at size-4096 (straddles the end)", c.read(c.size - 4096, 8192)[0], errno.EINVAL)
    expect_err("read at offset 2^63", c.read(1 << 63, 4096)[0], errno.EINVAL)
    check_usable(c, "reads past the end")
    c.close()


def case_write_past_end(path, export):
    c = Conn(path, export)
    expect_err("write 4096 at size", c.write(c.size, b"\xab" * 4096)[0], errno.ENOSPC)
    expect_err("write 8192 at size-4096 (straddles the end)", c.write(c.size - 4096, b"\xab" * 8192)[0], errno.ENOSPC)
    check_usable(c, "writes past the end")
    # Nothing of the straddling write may have landed in the last sector.
    err, data = c.read(c.size - 4096, 4096)
    if err:
        raise Fail("read of the last sector failed: %s" % ename(err))
    if data == b"\xab" * 4096:
        raise Fail("a rejected write past the end modified the last sector")
    c.close()


def case_misaligned(path, export):
    """Issue 13: the server advertises a minimum block size of 1 and serves byte ranges."""
    c = Conn(path, export)
    base = 40 * MiB  # a region no other case writes
    image = bytearray(os.urandom(16384))
    if c.write(base, bytes(image))[0]:
        raise Fail("aligned 16 KiB write failed")
    for off, length in ((0, 512), (1023, 1), (1024, 4096), (4097, 3000), (8191, 2)):
        data = os.urandom(length)
        err = c.write(base + off, data)[0]
        if err:
            raise Fail("write of %d bytes at +%d failed with %s" % (length, off, ename(err)))
        image[off:off + length] = data
    for off, length in ((0, 16384), (512, 512), (1, 8190), (4097, 3000)):
        err, got = c.read(base + off, length)
        if err or got != bytes(image[off:off + length]):
            raise Fail("read of %d bytes at +%d: err %s, data %s" % (
                length, off, ename(err) if err else 0, "right" if got == bytes(image[off:off + length]) else "wrong"))
    err = c.reply(c.request(CMD_WRITE_ZEROES, base + 100, 5000))[0]
    if err:
        raise Fail("write-zeroes of 5000 bytes at +100 failed with %s" % ename(err))
    image[100:5100] = bytes(5000)
    err, got = c.read(base, 16384)
    if err or got != bytes(image):
        raise Fail("after a partial write-zeroes the region differs (err %d)" % err)
    print("ok: byte-granular reads, writes and write-zeroes read back exactly")
    check_usable(c, "byte-granular requests")
    c.close()


def case_read_huge(path, export):
    c = Conn(path, export)
    expect_err("read of 33 MiB", c.read(0, 33 * MiB)[0], None)
    check_usable(c, "a 33 MiB read")
    c.close()


def case_write_huge(path, export):
    c = Conn(path, export)
    expect_err("write of 33 MiB (payload sent)", c.write(0, b"\xee" * (33 * MiB))[0], None)
    check_usable(c, "a 33 MiB write")
    err, data = c.read(0, 4096)
    if err == 0 and data == b"\xee" * 4096:
        raise Fail("the refused 33 MiB write modified the export")
    c.close()


def case_other_cmds(path, export):
    c = Conn(path, export)
    bad = (errno.EINVAL, errno.ENOSPC)
    for name, cmd in (("trim", CMD_TRIM), ("write-zeroes", CMD_WRITE_ZEROES)):
        expect_err("%s 4096 at size" % name, c.reply(c.request(cmd, c.size, 4096))[0], bad)
        expect_err("%s 8192 straddling the end" % name, c.reply(c.request(cmd, c.size - 4096, 8192))[0], bad)
    expect_err("cache 4096 at size", c.reply(c.request(CMD_CACHE, c.size, 4096))[0], errno.EINVAL)
    expect_err("unknown command 99", c.reply(c.request(99, 0, 4096))[0], errno.EINVAL)
    # Valid trim and write-zeroes work and read back zeros.
    pattern = b"\x5a" * 65536
    if c.write(1 << 20, pattern)[0]:
        raise Fail("valid 64 KiB write failed")
    for name, cmd in (("trim", CMD_TRIM), ("write-zeroes", CMD_WRITE_ZEROES)):
        if c.write(1 << 20, pattern)[0]:
            raise Fail("valid 64 KiB write failed")
        err = c.reply(c.request(cmd, 1 << 20, 65536))[0]
        if err:
            raise Fail("valid %s failed: %s" % (name, ename(err)))
        err, data = c.read(1 << 20, 65536)
        if err or data != bytes(65536):
            raise Fail("after a valid %s, the range does not read back zeros (err %d)" % (name, err))
        print("ok: valid %s reads back zeros" % name)
    err = c.reply(c.request(CMD_CACHE, 0, 1 << 20))[0]
    if err:
        raise Fail("valid NBD_CMD_CACHE of 1 MiB failed: %s" % ename(err))
    print("ok: valid NBD_CMD_CACHE succeeds")
    # Requests of exactly the advertised maximum (32 MiB) are served, at the very end too.
    big = os.urandom(1 << 20) * 32
    for off in (64 * MiB, c.size - 32 * MiB):
        err = c.write(off, big)[0]
        if err:
            raise Fail("32 MiB write at %d failed: %s" % (off, ename(err)))
        err, data = c.read(off, 32 * MiB)
        if err or data != big:
            raise Fail("32 MiB read at %d: error %d or different data" % (off, err))
    print("ok: 32 MiB (maximum) writes and reads round-trip, including the last 32 MiB")
    check_usable(c, "bad trim/write-zeroes/cache/unknown commands")
    c.close()


def case_read_only(path, export):
    c = Conn(path, export)
    if not c.flags & 2:
        raise Fail("NBD_FLAG_READ_ONLY not set in transmission flags 0x%x" % c.flags)
    expect_err("write on a read-only export", c.write(0, b"\x01" * 4096)[0], errno.EPERM)
    expect_err("trim on a read-only export", c.reply(c.request(CMD_TRIM, 0, 4096))[0], errno.EPERM)
    expect_err("write-zeroes on a read-only export", c.reply(c.request(CMD_WRITE_ZEROES, 0, 4096))[0], errno.EPERM)
    err, data = c.read(0, 4096)
    if err:
        raise Fail("read on a read-only export failed: %s" % ename(err))
    if data == b"\x01" * 4096:
        raise Fail("the refused write landed")
    print("ok: read-only export refuses writes with EPERM, reads work")
    c.close()


def greet(path):
    s = connect(path)
    g = recv_exact(s, 18)
    if g[:8] != NBDMAGIC:
        raise Fail("bad greeting")
    (hflags,) = struct.unpack(">H", g[16:18])
    s.sendall(struct.pack(">I", FLAG_FIXED_NEWSTYLE | (hflags & FLAG_NO_ZEROES)))
    return s, hflags


def opt_replies(s, opt):
    """Collects option replies up to and including the final one."""
    out = []
    for _ in range(10000):
        magic, ropt, rtype, rlen = struct.unpack(">QIII", recv_exact(s, 20))
        if magic != OPT_REPLY_MAGIC or ropt != opt:
            raise Fail("bad option reply: magic %x opt %d (sent %d)" % (magic, ropt, opt))
        out.append((rtype, recv_exact(s, rlen)))
        if rtype != REP_SERVER and rtype != REP_INFO:
            return out
    raise Fail("endless option replies")


def case_options(path, export):
    s, hflags = greet(path)
    # NBD_OPT_LIST: one REP_SERVER per export, then ACK.
    s.sendall(struct.pack(">QII", IHAVEOPT, OPT_LIST, 0))
    reps = opt_replies(s, OPT_LIST)
    if reps[-1][0] != REP_ACK:
        raise Fail("NBD_OPT_LIST did not end with ACK: %r" % (reps[-1],))
    names = []
    for rtype, data in reps[:-1]:
        (n,) = struct.unpack(">I", data[:4])
        names.append(data[4:4 + n].decode(errors="replace"))
    print("ok: NBD_OPT_LIST -> %s" % names)
    if export and export not in names:
        raise Fail("export %r not listed: %s" % (export, names))
    # Unknown option: ERR_UNSUP, and the session goes on.
    s.sendall(struct.pack(">QII", IHAVEOPT, 0x7777, 3) + b"abc")
    reps = opt_replies(s, 0x7777)
    if reps[-1][0] != REP_ERR_UNSUP:
        raise Fail("unknown option: reply type %x, expected NBD_REP_ERR_UNSUP" % reps[-1][0])
    print("ok: unknown option -> NBD_REP_ERR_UNSUP")
    # NBD_OPT_EXPORT_NAME (no reply framing: size, flags, maybe 124 zero bytes), then a read.
    name = export.encode()
    s.sendall(struct.pack(">QII", IHAVEOPT, OPT_EXPORT_NAME, len(name)) + name)
    size, flags = struct.unpack(">QH", recv_exact(s, 10))
    if not hflags & FLAG_NO_ZEROES:
        recv_exact(s, 124)
    c = Conn.__new__(Conn)
    c.s, c.handle, c.size, c.flags, c.block = s, 0, size, flags, None
    err, data = c.read(0, 4096)
    if err:
        raise Fail("read after NBD_OPT_EXPORT_NAME failed: %s" % ename(err))
    print("ok: NBD_OPT_EXPORT_NAME -> size %d flags 0x%x, read works" % (size, flags))
    c.close()
    # NBD_OPT_ABORT: the server acks (or just closes).
    s, _ = greet(path)
    s.sendall(struct.pack(">QII", IHAVEOPT, OPT_ABORT, 0))
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise Fail("server did not close the connection after NBD_OPT_ABORT")
    s.close()
    print("ok: NBD_OPT_ABORT closes the session")


def case_many_conns(path, export):
    conns = [Conn(path, export) for _ in range(64)]
    pattern = os.urandom(4096)
    if conns[0].write(12288, pattern)[0]:
        raise Fail("write on connection 0 failed")
    for i, c in enumerate(conns):
        err, data = c.read(12288, 4096)
        if err or data != pattern:
            raise Fail("connection %d of 64: error %d or stale data" % (i, err))
    for c in conns:
        c.close()
    print("ok: 64 simultaneous connections, all see the same data")


def case_hold(path, export):
    import time
    idle = Conn(path, export)
    half = Conn(path, export)
    half.request(CMD_WRITE, 0, MiB)
    half.s.sendall(b"\x99" * 4096)
    hs = connect(path)
    recv_exact(hs, 18)
    print("holding", flush=True)
    time.sleep(120)


def case_garbage(path, export):
    for attempt in range(3):
        s = connect(path)
        greeting = recv_exact(s, 18)
        if greeting[:8] != NBDMAGIC:
            raise Fail("bad greeting")
        # Client flags with undefined bits set, followed by junk: the server must hang up.
        junk = b"\xff\xff\xff\xfc" + os.urandom(4096)
        try:
            s.sendall(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed = False
        try:
            for _ in range(10000):
                if not s.recv(65536):
                    closed = True
                    break
        except ConnectionResetError:
            closed = True
        except socket.timeout:
            raise Fail("server kept a connection with a garbage handshake open for %ds" % TIMEOUT)
        if not closed:
            raise Fail("server kept sending data to a garbage handshake")
        s.close()
    # Garbage right from the first byte (no reading of the greeting).
    s = connect(path)
    try:
        s.sendall(os.urandom(65536))
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise Fail("server kept a garbage-only connection open for %ds" % TIMEOUT)
    s.close()
    # A valid handshake but garbage where a request should be.
    c = Conn(path, export)
    c.s.sendall(os.urandom(28))
    try:
        while c.s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        raise Fail("server kept a connection with a garbage request open for %ds" % TIMEOUT)
    c.s.close()
    print("ok: server closes connections after garbage handshakes / requests")


def case_disconnect_mid_write(path, export):
    c = Conn(path, export)
    c.request(CMD_WRITE, 0, MiB)
    c.s.sendall(b"\x77" * (MiB // 2))
    c.s.close()
    c = Conn(path, export)
    c.request(CMD_WRITE, 4 * MiB, 8 * MiB)
    c.s.sendall(b"\x77" * 4096)
    c.s.shutdown(socket.SHUT_RDWR)
    c.s.close()
    # Header cut short too.
    c = Conn(path, export)
    c.s.sendall(struct.pack(">IHHQ", REQUEST_MAGIC, 0, CMD_WRITE, 1))
    c.s.close()
    print("ok: disconnected in the middle of write payloads / headers")


CASES = {
    "handshake": case_handshake,
    "read-past-end": case_read_past_end,
    "write-past-end": case_write_past_end,
    "misaligned": case_misaligned,
    "read-huge": case_read_huge,
    "write-huge": case_write_huge,
    "other-cmds": case_other_cmds,
    "read-only": case_read_only,
    "options": case_options,
    "many-conns": case_many_conns,
    "hold": case_hold,
    "garbage": case_garbage,
    "disconnect-mid-write": case_disconnect_mid_write,
}


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    path, case = sys.argv[1], sys.argv[2]
    export = sys.argv[3] if len(sys.argv) > 3 else ""
    names = [n for n in CASES if n not in ("handshake", "read-only", "hold")] if case == "all" else [case]
    try:
        for n in names:
            if n not in CASES:
                print("unknown case %s" % n, file=sys.stderr)
                return 2
            CASES[n](path, export)
    except Fail as e:
        print("FAIL (%s): %s" % (case, e), file=sys.stderr)
        return 1
    except (OSError, struct.error) as e:
        print("FAIL (%s): %s: %s" % (case, type(e).__name__, e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
