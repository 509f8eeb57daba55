#!/usr/bin/env python3
"""Verifying NBD client for ssdcache's crash tests (kill -9 of the server under a running workload).

Usage:
  nbd_verify.py workload SOCKET STATE_FILE --seed N --seconds S --blocks B [--block-size 4096]
                [--export NAME] [--max-ops N] [--depth D] [--fua-percent P] [--flush-every N]
  nbd_verify.py verify SOCKET STATE_FILE [--export NAME] [--no-record]
  nbd_verify.py verify - STATE_FILE --file PATH
  nbd_verify.py selftest SOCKET [--export NAME]

workload  Writes random blocks (index 0..B-1, each block-size bytes, spread evenly over the export:
          block i is at offset i * STRIDE) whose content encodes (block, generation, seed) plus a
          SHA-256, so a reader can tell exactly which write it is. Some writes carry NBD_CMD_FLAG_FUA;
          about every --flush-every writes all writes in flight are drained and NBD_CMD_FLUSH is
          sent. Up to --depth writes (to distinct blocks) are in flight at once. Runs until
          --seconds or --max-ops; if the server dies (EOF, reset, broken pipe) it prints what
          completed and exits 0 -- that is the expected outcome in a kill -9 test. An NBD error
          reply, a protocol violation or a 60 s stall exit 1. Continues an existing STATE_FILE
          (generations keep increasing).
verify    Reads blocks 0..B-1 of the state file's geometry, and the never-written gaps between
          them, in large reads, and checks each block is exactly the last durable write of that
          block or one of the writes sent after it -- never older, never garbage, never another
          block's data; a never-written block and every gap must be all zeroes. Then reads it all
          again: the content must be identical (no flip-flop). On success the
          observed generations are appended to STATE_FILE (unless --no-record): after a restart the
          server has committed to them, so a later crash must not bring back anything older.
          Exit 0 with "verified N blocks: D at durable gen, L at later gen, Z zero", or 1 with
          the first violations. With --file PATH (SOCKET given as -) it reads a plain file instead,
          e.g. the backing file once no server runs: right after a verify that recorded, it must
          hold exactly the generations that verify observed.
selftest  On a scratch export that starts zero-filled (it WRITES to it; use a throwaway volume): a
          short workload, verify passes; then each kind of corruption is planted (garbage, another
          block's data, an older generation, a flipped byte, data in a never-written block or in a
          gap, zeroes in a written block, flip-flop on re-read) and verify must catch each one.

STATE_FILE is line based, appended and fsync'ed:
  H 1 <blocks> <block_size> <stride>   geometry (first line)
  W <block> <gen> <seed> <fua>         written BEFORE the write is sent (pending)
  F <gen>                              FUA write <gen> acknowledged -> durable
  D <lo> <hi>                          FLUSH acknowledged; every write with a generation in lo..hi
                                       (this session's writes so far) had been acknowledged before
                                       the flush was sent -> durable
  V <block> <gen>                      verify observed <gen> (0 = zeroes) after a restart
  # ...                                comment (session summaries)
Invariant kept by the workload: never two writes to the same block in flight, so a block's writes
are ordered by generation.
Only the simple-reply protocol is used (structured replies are never requested).
"""

import argparse
import errno
import hashlib
import os
import random
import socket
import struct
import sys
import tempfile
import time

NBDMAGIC = b"NBDMAGIC"
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF
FLAG_FIXED_NEWSTYLE = 1
FLAG_NO_ZEROES = 2
OPT_GO = 7
REP_ACK = 1
REP_INFO = 3
INFO_EXPORT = 0
TFLAG_READ_ONLY = 1 << 1
TFLAG_SEND_FLUSH = 1 << 2
TFLAG_SEND_FUA = 1 << 3
CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_FLAG_FUA = 1

BLOCK_MAGIC = b"SSDCVRFY"
HDR = struct.Struct(">8sQQQQ")  # magic, block, generation, seed, block size
IO_TIMEOUT = 60.0
MAX_SHOWN = 10


class Fail(Exception):
    """A real failure: protocol violation, NBD error reply, bad state file."""


class ServerGone(Exception):
    """The server went away (EOF / reset / broken pipe): expected in kill -9 tests."""


# ---------------------------------------------------------------------------------------------
# NBD connection (simple replies, out-of-order replies matched by handle)

class Conn:
    def __init__(self, path, export=""):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(IO_TIMEOUT)
        self.handle = 0
        try:
            self.s.connect(path)
            self._handshake(export)
        except (ConnectionError, BrokenPipeError, ConnectionRefusedError, FileNotFoundError) as e:
            raise ServerGone("during connect/handshake: %s" % e)

    def _recv(self, n):
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = self.s.recv_into(view[got:])
            except socket.timeout:
                raise Fail("no data from the server for %ds (hung?)" % IO_TIMEOUT)
            except (ConnectionResetError, ConnectionAbortedError) as e:
                raise ServerGone(str(e))
            if not k:
                raise ServerGone("EOF from the server (wanted %d more bytes)" % (n - got))
            got += k
        return bytes(buf)

    def _send(self, data):
        try:
            self.s.sendall(data)
        except socket.timeout:
            raise Fail("could not send to the server for %ds (hung?)" % IO_TIMEOUT)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as e:
            raise ServerGone(str(e))

    def _handshake(self, export):
        if self._recv(8) != NBDMAGIC:
            raise Fail("bad greeting magic")
        (opt_magic,) = struct.unpack(">Q", self._recv(8))
        if opt_magic != IHAVEOPT:
            raise Fail("server is not newstyle")
        (hflags,) = struct.unpack(">H", self._recv(2))
        if not hflags & FLAG_FIXED_NEWSTYLE:
            raise Fail("server does not offer fixed newstyle")
        self._send(struct.pack(">I", FLAG_FIXED_NEWSTYLE | (hflags & FLAG_NO_ZEROES)))
        name = export.encode()
        data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
        self._send(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
        self.size = self.flags = None
        for _ in range(1000):
            magic, opt, rtype, rlen = struct.unpack(">QIII", self._recv(20))
            if magic != OPT_REPLY_MAGIC or opt != OPT_GO:
                raise Fail("bad option reply (magic %x, option %d)" % (magic, opt))
            payload = self._recv(rlen)
            if rtype == REP_ACK:
                break
            if rtype & 0x80000000:
                raise Fail("NBD_OPT_GO for export %r refused: reply type %x %r" % (export, rtype, payload))
            if rtype == REP_INFO and len(payload) >= 12:
                (itype,) = struct.unpack(">H", payload[:2])
                if itype == INFO_EXPORT:
                    self.size, self.flags = struct.unpack(">QH", payload[2:12])
        else:
            raise Fail("endless NBD_OPT_GO replies")
        if self.size is None:
            raise Fail("no NBD_INFO_EXPORT before NBD_REP_ACK")

    def send(self, cmd, offset, length, payload=b"", flags=0):
        """Sends one request, returns its handle (not sent if it is part of a batch: see send_many)."""
        self.handle += 1
        self._send(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, self.handle, offset, length) + payload)
        return self.handle

    def pack(self, cmd, offset, length, payload=b"", flags=0):
        """Builds a request for a batch; returns (handle, bytes)."""
        self.handle += 1
        return self.handle, struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, self.handle, offset, length) + payload

    def send_raw(self, data):
        self._send(data)

    def reply(self, read_len_of):
        """Receives one simple reply; read_len_of maps in-flight handle -> bytes of read data."""
        magic, err, h = struct.unpack(">IIQ", self._recv(16))
        if magic == STRUCTURED_REPLY_MAGIC:
            raise Fail("structured reply although none was negotiated")
        if magic != SIMPLE_REPLY_MAGIC:
            raise Fail("bad reply magic %x" % magic)
        if h not in read_len_of:
            raise Fail("reply for handle %d, which is not in flight" % h)
        n = read_len_of.pop(h)
        data = self._recv(n) if (err == 0 and n) else b""
        return h, err, data

    def close(self):
        try:
            self.s.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_DISC, 0, 0, 0))
        except OSError:
            pass
        self.s.close()


def ename(e):
    return "%d (%s)" % (e, errno.errorcode.get(e, "?"))


# ---------------------------------------------------------------------------------------------
# Block content

def make_block(block, gen, seed, bs):
    hdr = HDR.pack(BLOCK_MAGIC, block, gen, seed, bs)
    rng = random.Random(int.from_bytes(hashlib.sha256(hdr).digest()[:16], "big"))
    body = hdr + rng.randbytes(bs - HDR.size - 32)
    return body + hashlib.sha256(body).digest()


def describe(data, bs):
    """What a block's content is, whatever block it was read from."""
    if data == bytes(len(data)):
        return "zeroes"
    if len(data) >= HDR.size + 32:
        magic, b, g, s, hbs = HDR.unpack(data[:HDR.size])
        if magic == BLOCK_MAGIC:
            intact = hashlib.sha256(data[:-32]).digest() == data[-32:] and hbs == bs
            return "%s write of block %d gen %d seed %d" % ("an intact" if intact else "a CORRUPT", b, g, s)
    nz = sum(1 for x in data if x)
    return "garbage (%d non-zero bytes, starts %s)" % (nz, data[:16].hex())


# ---------------------------------------------------------------------------------------------
# State file

class State:
    def __init__(self):
        self.blocks = self.bs = self.stride = None
        self.base = {}       # block -> generation known to be there at least (0 = zeroes)
        self.pending = {}    # block -> [generations sent after base, ascending]
        self.write_of = {}   # gen -> (block, seed)
        self.unflushed = set()  # blocks with pending writes, for D processing
        self.max_gen = 0
        self.lines = 0

    def apply(self, f, lineno):
        t = f[0]
        if t == "H":
            geo = tuple(int(x) for x in f[2:5])
            if self.blocks is not None and geo != (self.blocks, self.bs, self.stride):
                raise Fail("state line %d: geometry %s differs from %s" % (lineno, geo, (self.blocks, self.bs, self.stride)))
            self.blocks, self.bs, self.stride = geo
        elif t == "W":
            b, g, s = int(f[1]), int(f[2]), int(f[3])
            if g <= self.max_gen:
                raise Fail("state line %d: generation %d not increasing" % (lineno, g))
            self.max_gen = g
            self.write_of[g] = (b, s)
            self.pending.setdefault(b, []).append(g)
            self.unflushed.add(b)
        elif t == "F":
            g = int(f[1])
            if g not in self.write_of:
                raise Fail("state line %d: FUA ack for unknown generation %d" % (lineno, g))
            b = self.write_of[g][0]
            self._durable(b, g)
        elif t == "D":
            lo, hi = int(f[1]), int(f[2])
            for b in list(self.unflushed):
                gens = [g for g in self.pending[b] if lo <= g <= hi]
                if gens:
                    self._durable(b, gens[-1])
        elif t == "V":
            b, g = int(f[1]), int(f[2])
            self.base[b] = g
            self.pending.pop(b, None)
            self.unflushed.discard(b)
        else:
            raise Fail("state line %d: unknown record %r" % (lineno, " ".join(f)))

    def _durable(self, b, g):
        if g > self.base.get(b, 0):
            self.base[b] = g
        later = [x for x in self.pending.get(b, []) if x > self.base.get(b, 0)]
        if later:
            self.pending[b] = later
        else:
            self.pending.pop(b, None)
            self.unflushed.discard(b)

    def allowed(self, b):
        return self.base.get(b, 0), self.pending.get(b, [])

    def mentioned(self):
        return set(self.base) | set(self.pending)


def load_state(path, must_exist):
    st = State()
    if not os.path.exists(path):
        if must_exist:
            raise Fail("state file %s does not exist" % path)
        return st
    with open(path, "rb") as fh:
        raw = fh.read()
    text = raw.decode("ascii", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] != "":
        # A torn last line (the writer was killed mid-append): ignore it.
        print("note: ignoring a torn last line in %s: %r" % (path, lines[-1][:60]), file=sys.stderr)
    for i, line in enumerate(lines[:-1], 1):
        if not line or line[0] == "#":
            continue
        st.apply(line.split(), i)
        st.lines += 1
    return st


def scan_state(path):
    """Fast scan for the workload: (blocks, block size, stride) or None, and the highest generation.
    Call after StateWriter() has cut any torn last line."""
    if not os.path.exists(path):
        return None, 0
    with open(path, "rb") as fh:
        text = fh.read().decode("ascii", errors="replace")
    geo = None
    for line in text.split("\n", 64)[:64]:
        if line.startswith("H "):
            f = line.split()
            geo = (int(f[2]), int(f[3]), int(f[4]))
            break
    i = text.rfind("\nW ")
    max_gen = int(text[i + 1:].split("\n", 1)[0].split()[2]) if i >= 0 else 0
    return geo, max_gen


class StateWriter:
    def __init__(self, path):
        # Cut a torn last line so appends start on a line boundary.
        if os.path.exists(path):
            with open(path, "rb") as fh:
                raw = fh.read()
            if raw and not raw.endswith(b"\n"):
                with open(path, "r+b") as fh:
                    fh.truncate(raw.rfind(b"\n") + 1)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.buf = []

    def add(self, line):
        self.buf.append(line + "\n")

    def sync(self):
        if self.buf:
            data = "".join(self.buf).encode()
            self.buf = []
            n = 0
            while n < len(data):
                n += os.write(self.fd, data[n:])
            os.fsync(self.fd)

    def close(self):
        self.sync()
        os.close(self.fd)


# ---------------------------------------------------------------------------------------------
# workload

def cmd_workload(a):
    conn = None
    writes = fua_acked = flushes = 0
    t0 = time.monotonic()
    why = "time limit reached"
    sw = None
    try:
        sw = StateWriter(a.state)
        geo, gen = scan_state(a.state)
        conn = Conn(a.socket, a.export)
        if conn.flags & TFLAG_READ_ONLY:
            raise Fail("export is read-only")
        if not conn.flags & TFLAG_SEND_FLUSH or not conn.flags & TFLAG_SEND_FUA:
            raise Fail("export does not advertise FLUSH and FUA (flags 0x%x)" % conn.flags)
        bs = a.block_size
        if geo is None:
            stride = max(bs, (conn.size // a.blocks) // bs * bs)
            if a.blocks * stride > conn.size:
                raise Fail("%d blocks of %d bytes do not fit the export (%d bytes)" % (a.blocks, bs, conn.size))
            sw.add("H 1 %d %d %d" % (a.blocks, bs, stride))
        else:
            if geo[:2] != (a.blocks, bs):
                raise Fail("state file geometry (%d blocks of %d) differs from --blocks %d --block-size %d"
                           % (geo[0], geo[1], a.blocks, bs))
            stride = geo[2]
            if a.blocks * stride > conn.size:
                raise Fail("state geometry (%d blocks, stride %d) exceeds the export size %d" % (a.blocks, stride, conn.size))
        rng = random.Random(a.seed)
        first_gen = gen + 1
        sw.add("# workload seed %d start gen %d" % (a.seed, gen + 1))
        sw.sync()
        since_flush = 0
        next_flush = rng.randint(max(1, a.flush_every // 2), a.flush_every * 3 // 2)
        deadline = t0 + a.seconds
        while writes < a.max_ops and time.monotonic() < deadline:
            # One round: up to `depth` writes to distinct blocks, all in flight at once.
            k = rng.randint(1, a.depth)
            k = min(k, a.max_ops - writes, next_flush - since_flush)
            chosen = set()
            batch = []
            for _ in range(k):
                for _try in range(20):
                    b = rng.randrange(a.blocks)
                    if b not in chosen:
                        break
                else:
                    continue
                chosen.add(b)
                gen += 1
                fua = rng.randrange(100) < a.fua_percent
                batch.append((b, gen, fua))
                sw.add("W %d %d %d %d" % (b, gen, a.seed, int(fua)))
            sw.sync()  # pending records are durable before anything is sent
            inflight = {}
            fua_of = {}
            out = []
            for b, g, fua in batch:
                h, req = conn.pack(CMD_WRITE, b * stride, bs, make_block(b, g, a.seed, bs), CMD_FLAG_FUA if fua else 0)
                inflight[h] = 0
                fua_of[h] = (g, fua)
                out.append(req)
            conn.send_raw(b"".join(out))
            while inflight:
                h, err, _ = conn.reply(inflight)
                g, fua = fua_of[h]
                if err:
                    raise Fail("write of generation %d failed: NBD error %s" % (g, ename(err)))
                writes += 1
                since_flush += 1
                if fua:
                    fua_acked += 1
                    sw.add("F %d" % g)
            sw.sync()
            if since_flush >= next_flush:
                # Every write up to `gen` is acknowledged (the round is drained) before the flush.
                h = conn.send(CMD_FLUSH, 0, 0)
                _, err, _ = conn.reply({h: 0})
                if err:
                    raise Fail("flush failed: NBD error %s" % ename(err))
                flushes += 1
                sw.add("D %d %d" % (first_gen, gen))
                sw.sync()
                since_flush = 0
                next_flush = rng.randint(max(1, a.flush_every // 2), a.flush_every * 3 // 2)
        if writes >= a.max_ops:
            why = "op limit reached"
        conn.close()
    except ServerGone as e:
        why = "server went away (%s)" % e
    except Fail as e:
        print("workload FAIL after %d writes, %d flushes: %s" % (writes, flushes, e), file=sys.stderr)
        if sw:
            sw.sync()
        return 1
    dt = time.monotonic() - t0
    summary = "workload: writes=%d fua=%d flushes=%d seconds=%.1f: %s" % (writes, fua_acked, flushes, dt, why)
    if sw:
        sw.add("# " + summary)
        sw.close()
    print(summary)
    return 0


# ---------------------------------------------------------------------------------------------
# verify

def check(st, blocks, first, second):
    """Returns (violations, counts, observations)."""
    bs = st.bs
    bad = []
    n_durable = n_later = n_zero = 0
    observed = {}
    zero = bytes(bs)
    for b in blocks:
        data = first[b]
        base, later = st.allowed(b)
        if data == zero:
            if base == 0:
                if later:
                    n_durable += 1  # written, but none of it durable yet: zeroes are still allowed
                else:
                    n_zero += 1
                observed[b] = 0
            else:
                bad.append("block %d reads zeroes, but generation %d was durable%s"
                           % (b, base, " (later: %s)" % later[:5] if later else ""))
        else:
            magic, hb, g, s, hbs = HDR.unpack(data[:HDR.size])
            ok = (magic == BLOCK_MAGIC and hb == b and (g == base or g in later)
                  and st.write_of.get(g) == (b, s) and hbs == bs
                  and hashlib.sha256(data[:-32]).digest() == data[-32:])
            if ok:
                observed[b] = g
                if g == base:
                    n_durable += 1
                else:
                    n_later += 1
            else:
                what = describe(data, bs)
                why = ""
                if magic == BLOCK_MAGIC and hb == b and g in st.write_of and st.write_of[g][0] == b and g < base:
                    why = " (STALE: older than the durable generation)"
                elif magic == BLOCK_MAGIC and hb != b:
                    why = " (MISDIRECTED: another block's data)"
                bad.append("block %d (offset %d) holds %s%s; allowed: %s%s"
                           % (b, b * st.stride, what, why,
                              "zeroes" if base == 0 else "gen %d" % base,
                              " or later gens %s" % later[:8] if later else ""))
        if second is not None and second[b] != data:
            bad.append("block %d FLIP-FLOP: first read %s, second read %s"
                       % (b, describe(data, bs), describe(second[b], bs)))
    return bad, (n_durable, n_later, n_zero), observed


class FileSource:
    """Reads a plain file or device (e.g. the backing file after the server stopped) instead of NBD."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size or os.lseek(self.fd, 0, os.SEEK_END)

    def read_many(self, reqs):
        out = []
        for off, n in reqs:
            data = os.pread(self.fd, n, off)
            if len(data) != n:
                raise Fail("short read of %d bytes at %d (got %d)" % (n, off, len(data)))
            out.append(data)
        return out

    def close(self):
        os.close(self.fd)


class NbdSource:
    def __init__(self, path, export):
        self.conn = Conn(path, export)
        self.size = self.conn.size

    def read_many(self, reqs):
        """Pipelined reads; returns the data in request order."""
        lens, index, out = {}, {}, [None] * len(reqs)
        packets = []
        for i, (off, n) in enumerate(reqs):
            h, req = self.conn.pack(CMD_READ, off, n)
            lens[h] = n
            index[h] = i
            packets.append(req)
        self.conn.send_raw(b"".join(packets))
        while lens:
            h, err, data = self.conn.reply(lens)
            if err:
                off, n = reqs[index[h]]
                raise Fail("read of %d bytes at offset %d failed: NBD error %s" % (n, off, ename(err)))
            out[index[h]] = data
        return out

    def close(self):
        self.conn.close()


def read_region(src, st, pass_no, bad, chunk_max=256 << 10, depth=32):
    """Reads blocks 0..B-1 with the gaps between them in large pipelined reads; returns
    {block: data} and appends a violation to `bad` for every gap that is not zeroes."""
    per = max(1, chunk_max // st.stride)          # blocks per read
    gap_zero = bytes(st.stride - st.bs)
    out = {}
    starts = list(range(0, st.blocks, per))
    for i in range(0, len(starts), depth):
        batch = starts[i:i + depth]
        reqs = [(b0 * st.stride, min(per, st.blocks - b0) * st.stride) for b0 in batch]
        for b0, data in zip(batch, src.read_many(reqs)):
            for j in range(len(data) // st.stride):
                o = j * st.stride
                out[b0 + j] = data[o:o + st.bs]
                if gap_zero and data[o + st.bs:o + st.stride] != gap_zero:
                    gap = bytes(data[o + st.bs:o + st.stride])
                    nz = (len(gap) - len(gap.lstrip(b"\0"))) // st.bs * st.bs  # first non-zero page
                    start = (b0 + j) * st.stride + st.bs
                    bad.append("pass %d: the gap after block %d (offset %d..%d, never written) holds at %d %s"
                               % (pass_no, b0 + j, start, start + len(gap), start + nz,
                                  describe(gap[nz:nz + st.bs], st.bs)))
    return out


def run_verify(socket_path, state_path, export="", record=True, tamper=None, quiet=False, file=None):
    if not os.path.exists(state_path):
        raise Fail("state file %s does not exist" % state_path)
    geo, _ = scan_state(state_path)
    if geo is None:
        raise Fail("state file %s has no geometry line (no workload ever connected?)" % state_path)
    g = argparse.Namespace(blocks=geo[0], bs=geo[1], stride=geo[2])
    src = FileSource(file) if file else NbdSource(socket_path, export)
    if g.blocks * g.stride > src.size:
        raise Fail("state geometry (%d blocks, stride %d) exceeds the size %d" % (g.blocks, g.stride, src.size))
    gap_bad = []
    first = read_region(src, g, 1, gap_bad)
    second = read_region(src, g, 2, gap_bad)
    src.close()
    st = load_state(state_path, must_exist=True)
    if (st.blocks, st.bs, st.stride) != geo:
        raise Fail("state file geometry changed while reading it")
    mentioned = st.mentioned()
    blocks = range(st.blocks)
    if tamper:
        first, second = tamper(first, second)
    bad, (nd, nl, nz), observed = check(st, blocks, first, second)
    bad += gap_bad
    if bad:
        if not quiet:
            print("verify FAIL: %d violation(s) in %d blocks read twice (state: %d records, max gen %d); first ones:"
                  % (len(bad), len(blocks), st.lines, st.max_gen), file=sys.stderr)
            for m in bad[:MAX_SHOWN]:
                print("  " + m, file=sys.stderr)
        return False, bad
    if record:
        sw = StateWriter(state_path)
        for b in sorted(observed):
            base, later = st.allowed(b)
            if later or observed[b] != base:
                sw.add("V %d %d" % (b, observed[b]))
        sw.add("# verify: %d blocks, %d durable, %d later, %d zero" % (len(blocks), nd, nl, nz))
        sw.close()
    if not quiet:
        print("verified %d blocks%s: %d at durable gen, %d at later gen, %d zero (never written, or no"
              " write of it landed); %d blocks ever written, max gen %d"
              % (len(blocks), " in file %s" % file if file else "", nd, nl, nz, len(mentioned), st.max_gen))
    return True, []


def cmd_verify(a):
    if a.file and a.socket != "-":
        raise Fail("with --file, give - as SOCKET")
    ok, _ = run_verify(a.socket, a.state, a.export, record=not a.no_record and not a.file, file=a.file)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# selftest

def state_logic_selftest():
    """The durable/pending bookkeeping, on synthetic records."""
    st = State()
    steps = [
        ("H 1 16 4096 4096", {}),
        ("W 5 1 9 0", {5: (0, [1])}),            # sent, not acknowledged: zeroes or gen 1
        ("W 5 2 9 1", {5: (0, [1, 2])}),
        ("F 2", {5: (2, [])}),                   # FUA ack: gen 2 durable, gen 1 can no longer show
        ("W 5 3 9 0", {5: (2, [3])}),
        ("W 6 4 9 0", {5: (2, [3]), 6: (0, [4])}),
        ("W 5 5 9 0", {5: (2, [3, 5])}),
        ("D 3 4", {5: (3, [5]), 6: (4, [])}),     # flush covers gens 3..4 only
        ("V 5 5", {5: (5, [])}),                 # verify saw gen 5: nothing older may come back
        ("W 7 6 9 0", {7: (0, [6])}),            # a session dies with gen 6 unacknowledged
        ("W 8 7 10 0", {7: (0, [6]), 8: (0, [7])}),
        ("D 7 7", {7: (0, [6]), 8: (7, [])}),    # the next session's flush does not cover gen 6
        ("V 7 0", {7: (0, [])}),
    ]
    for i, (line, want) in enumerate(steps, 1):
        st.apply(line.split(), i)
        for b, (base, later) in want.items():
            got = st.allowed(b)
            if got != (base, later):
                raise Fail("state logic after %r: block %d allowed %s, expected %s" % (line, b, got, (base, later)))
    for bad in ("W 9 3 1 0", "F 99", "Q 1"):
        try:
            st.apply(bad.split(), 99)
        except Fail:
            continue
        raise Fail("state logic: %r was accepted" % bad)
    print("selftest ok: durable/pending bookkeeping (%d synthetic records)" % len(steps))


def cmd_selftest(a):
    state_logic_selftest()
    d = tempfile.mkdtemp(prefix="nbd_verify_selftest.")
    state = os.path.join(d, "state")
    blocks, bs = 256, 4096

    def workload(seed, ops):
        ns = argparse.Namespace(socket=a.socket, state=state, seed=seed, seconds=60, blocks=blocks,
                                block_size=bs, export=a.export, max_ops=ops, depth=8, fua_percent=10,
                                flush_every=20)
        if cmd_workload(ns) != 0:
            raise Fail("selftest workload failed")

    def expect(desc, want_ok, needle=None, tamper=None):
        ok, bad = run_verify(a.socket, state, a.export, record=False, tamper=tamper, quiet=True)
        if ok != want_ok:
            raise Fail("selftest %s: verify %s, expected it to %s%s" % (
                desc, "passed" if ok else "failed", "pass" if want_ok else "fail",
                (": " + "; ".join(bad[:3])) if bad else ""))
        if needle and not any(needle in m for m in bad):
            raise Fail("selftest %s: violations do not mention %r: %s" % (desc, needle, bad[:3]))
        print("selftest ok: %s -> %s%s" % (desc, "pass" if ok else "caught",
                                           (": " + bad[0]) if bad else ""))

    workload(101, 400)
    workload(102, 300)  # a second session continues the same state file
    expect("clean export", True)
    st = load_state(state, must_exist=True)
    written = sorted(st.mentioned())
    unwritten = [b for b in range(blocks) if b not in st.mentioned()]
    if len(written) < 10 or not unwritten:
        raise Fail("selftest: workload wrote %d blocks, need >= 10 and some unwritten" % len(written))
    conn = Conn(a.socket, a.export)

    def put(b, data):
        h = conn.send(CMD_WRITE, b * st.stride, bs, data, CMD_FLAG_FUA)
        _, err, _ = conn.reply({h: 0})
        if err:
            raise Fail("selftest write failed: %s" % ename(err))

    def get(b):
        h = conn.send(CMD_READ, b * st.stride, bs)
        _, err, data = conn.reply({h: bs})
        if err:
            raise Fail("selftest read failed: %s" % ename(err))
        return bytes(data)

    victim, other = written[0], written[-1]
    keep = get(victim)
    put(victim, os.urandom(bs))
    expect("garbage in a written block", False, "garbage")
    put(victim, keep)
    expect("restored block", True)

    put(victim, get(other))
    expect("another block's data", False, "MISDIRECTED")
    put(victim, keep)

    # a block with a write older than its durable generation
    stale = [(b, g) for g, (b, _) in sorted(st.write_of.items()) if 0 < g < st.base.get(b, 0)]
    if not stale:
        raise Fail("selftest: no block has a write older than its durable generation")
    b, g = stale[0]
    keep_b = get(b)
    put(b, make_block(b, g, st.write_of[g][1], bs))
    expect("an older generation (gen %d, durable %d)" % (g, st.base[b]), False, "STALE")
    put(b, keep_b)

    corrupt = bytearray(keep)
    corrupt[100] ^= 0xFF
    put(victim, bytes(corrupt))
    expect("one flipped byte", False, "CORRUPT")
    put(victim, keep)

    put(unwritten[0], make_block(unwritten[0], 1, 1, bs))
    expect("data in a never-written block", False, "allowed: zeroes")
    put(unwritten[0], bytes(bs))

    put(victim, bytes(bs))
    expect("zeroes in a written block", False, "reads zeroes")
    put(victim, keep)

    if st.stride > bs:
        gap = victim * st.stride + bs
        h = conn.send(CMD_WRITE, gap, bs, make_block(victim, 1, 1, bs), CMD_FLAG_FUA)
        if conn.reply({h: 0})[1]:
            raise Fail("selftest write failed")
        expect("data in the gap after a block", False, "gap after block %d" % victim)
        h = conn.send(CMD_WRITE, gap, bs, bytes(bs), CMD_FLAG_FUA)
        if conn.reply({h: 0})[1]:
            raise Fail("selftest write failed")
    conn.close()

    def flip(first, second):
        second = dict(second)
        second[victim] = get_other
        return first, second
    get_other = keep_b if keep_b != keep else bytes(bs)
    expect("flip-flop on re-read", False, "FLIP-FLOP", tamper=flip)
    expect("everything restored", True)
    os.unlink(state)
    os.rmdir(d)
    print("selftest passed")
    return 0


# ---------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description="Verifying NBD client for crash tests.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("workload")
    w.add_argument("socket")
    w.add_argument("state")
    w.add_argument("--seed", type=int, required=True)
    w.add_argument("--seconds", type=float, required=True)
    w.add_argument("--blocks", type=int, required=True)
    w.add_argument("--block-size", type=int, default=4096)
    w.add_argument("--export", default="")
    w.add_argument("--max-ops", type=int, default=2_000_000)
    w.add_argument("--depth", type=int, default=8, help="writes in flight at once (1 = sequential)")
    w.add_argument("--fua-percent", type=int, default=10)
    w.add_argument("--flush-every", type=int, default=20)
    v = sub.add_parser("verify")
    v.add_argument("socket")
    v.add_argument("state")
    v.add_argument("--export", default="")
    v.add_argument("--no-record", action="store_true", help="do not append the observed generations")
    v.add_argument("--file", help="read this file/device instead of an NBD export (SOCKET must be -);"
                   " never records")
    s = sub.add_parser("selftest")
    s.add_argument("socket")
    s.add_argument("--export", default="")
    a = p.parse_args()
    if a.cmd == "workload":
        if a.blocks < 1 or a.block_size < 512 or a.block_size % 512 or a.depth < 1 or a.flush_every < 1:
            p.error("bad --blocks/--block-size/--depth/--flush-every")
    try:
        return {"workload": cmd_workload, "verify": cmd_verify, "selftest": cmd_selftest}[a.cmd](a)
    except ServerGone as e:
        print("FAIL (%s): the server went away: %s" % (a.cmd, e), file=sys.stderr)
        return 1
    except Fail as e:
        print("FAIL (%s): %s" % (a.cmd, e), file=sys.stderr)
        return 1
    except (OSError, struct.error) as e:
        print("FAIL (%s): %s: %s" % (a.cmd, type(e).__name__, e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
