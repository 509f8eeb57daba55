#!/usr/bin/env bash
# Malformed and out-of-range NBD traffic (raw protocol client), corrupted superblocks, a replaced
# or resized backing, and every `create` refusal.
source "$(dirname "$0")/lib.sh"
require_tool python3 qemu-io truncate dd sha256sum
require_bin
RAW="$E2E_DIR/nbd_raw.py"
[[ -r "$RAW" ]] || fail "missing $RAW"
M=$((1024 * 1024))

mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name vol0 --mode write-through

start_server "$TEST_DIR/nbd.sock" --cache cache.img
URI=$(nbd_uri "$SOCK")

out=$(timeout -k 5 30 python3 "$RAW" "$SOCK" handshake) || fail "raw handshake failed: $out"
log "raw handshake: $out"
assert_contains "$out" "size=$((512 * M))" "raw handshake size"

n=0
for c in options read-past-end write-past-end misaligned read-huge write-huge other-cmds many-conns garbage disconnect-mid-write; do
    rc=0
    out=$(timeout -k 5 120 python3 "$RAW" "$SOCK" "$c" 2>&1) || rc=$?
    [[ $rc -eq 0 ]] || fail "raw NBD case '$c' (status $rc):
$out"
    log "$c: $(tr '\n' ';' <<<"$out")"
    assert_server_alive
    # A fresh, well-behaved connection still works and sees consistent data.
    n=$((n + 1))
    qio "$URI" "write -P $n $((16 * M)) $((64 * 1024))" "read -P $n $((16 * M)) $((64 * 1024))" >/dev/null
done
# The interrupted writes (pattern 0x77 at 0 and 4 MiB) must not have produced partial junk
# anywhere outside what was actually sent: the rest of line 0 region after 512 KiB stays zero.
qio "$URI" "read -P 0 $((M)) $((3 * M))" "read -P 0 $((4 * M + 64 * 1024)) $((M))" >/dev/null
log "protocol abuse survived; server alive"

# A second daemon on the same cache is refused (and does not disturb the first).
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/second.sock"
log "second serve on the same cache refused: $(head -c 300 <<<"$out")"
grep -Eqi 'in use|lock|running|already|busy' <<<"$out" || fail "second serve: unclear message: $out"
assert_server_alive
qio "$URI" "read -P $n $((16 * M)) $((64 * 1024))" >/dev/null

# A graceful stop is not held up by clients: an idle session, one stuck in the middle of a write
# payload, one stuck in the handshake. The server must exit 0 within 20 s.
python3 "$RAW" "$SOCK" hold >"$TEST_DIR/hold.out" 2>&1 &
HOLD_PID=$!
_PIDS+=("$HOLD_PID")
for ((i = 0; i < 200; i++)); do
    grep -q holding "$TEST_DIR/hold.out" && break
    _is_ours_alive "$HOLD_PID" || fail "hold helper died: $(cat "$TEST_DIR/hold.out")"
    sleep 0.1
done
grep -q holding "$TEST_DIR/hold.out" || fail "hold helper did not connect"
t0=$(date +%s)
SERVER_STOP_TIMEOUT=20 stop_server
log "SIGTERM with stuck clients connected: clean exit in $(( $(date +%s) - t0 ))s"
kill "$HOLD_PID" 2>/dev/null || true
wait "$HOLD_PID" 2>/dev/null || true
start_server "$TEST_DIR/nbd.sock" --cache cache.img
# The half-sent write (0x99 at offset 0) was never completed, so it must not be visible.
out=$(qio "$URI" "read -v 0 4096")
out=$(head -n 1 <<<"$out")
grep -q ' 99 99 99 99 99 99 99 99' <<<"$out" && fail "a write whose payload never fully arrived was applied: $out"

# ---- create refusals ----
sha_before=$(sha256sum backing.img | cut -d' ' -f1)

# The backing is in use by the running server.
mk_sparse cache2.img 64M
expect_fail_stderr "create on a backing in use" 'use|busy|running|lock|serv' \
    "$SSDCACHE_BIN" create --cache cache2.img --backing backing.img
stop_server

mk_sparse small.img 8M
expect_fail_stderr "cache too small" 'small|minimum|at least' \
    "$SSDCACHE_BIN" create --cache small.img --backing backing.img
expect_fail_stderr "cache and backing the same file" 'same' \
    "$SSDCACHE_BIN" create --cache backing.img --backing backing.img
ln -s backing.img backing-link.img
expect_fail_stderr "cache and backing the same file (via a symlink)" 'same' \
    "$SSDCACHE_BIN" create --cache backing-link.img --backing backing.img
expect_fail_stderr "existing superblock without --force" 'superblock|already|force|exist' \
    "$SSDCACHE_BIN" create --cache cache.img --backing backing.img
expect_fail_stderr "unknown replacement policy" 'unknown policy.*lru, fifo, clock, arc, s3fifo' \
    "$SSDCACHE_BIN" create --cache cache.img --backing backing.img --force --policy nope
truncate -s $((32 * M + 512)) odd-cache.img
expect_fail_stderr "cache size not a multiple of 4096" '4096|multiple|align|sector' \
    "$SSDCACHE_BIN" create --cache odd-cache.img --backing backing.img
truncate -s $((64 * M + 1000)) odd-backing.img
expect_fail_stderr "backing size not a multiple of 4096" '4096|multiple|align|sector' \
    "$SSDCACHE_BIN" create --cache cache2.img --backing odd-backing.img
expect_fail_stderr "missing cache path" 'no such|not found|open|exist|read|access' \
    "$SSDCACHE_BIN" create --cache "$TEST_DIR/does-not-exist.img" --backing backing.img
expect_fail_stderr "missing backing path" 'no such|not found|open|exist|read|access' \
    "$SSDCACHE_BIN" create --cache cache2.img --backing "$TEST_DIR/does-not-exist.img"
sha_after=$(sha256sum backing.img | cut -d' ' -f1)
assert_eq "$sha_after" "$sha_before" "backing content after refused creates"
# ... and the refused creates did not damage the existing cache: it still serves, warm.
start_server "$TEST_DIR/nbd.sock" --cache cache.img
qio "$URI" "read -P $n $((16 * M)) $((64 * 1024))" >/dev/null
stop_server
# --force does re-create over an existing superblock.
out=$("$SSDCACHE_BIN" create --cache cache.img --backing backing.img --name vol0 --force 2>&1) ||
    fail "create --force over an existing superblock failed: $out"
log "create refusals ok"

# ---- superblock corruption ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img
qio "$URI" "read -P $n $((16 * M)) $((64 * 1024))" >/dev/null
stop_server
# Only copy A (first 64 KiB) destroyed: copy B still serves.
dd if=/dev/urandom of=cache.img bs=64k count=1 conv=notrunc status=none
start_server "$TEST_DIR/nbd.sock" --cache cache.img
qio "$URI" "read -P $n $((16 * M)) $((64 * 1024))" >/dev/null
stop_server
log "copy A destroyed: still serves from copy B"
# Both copies destroyed.
dd if=/dev/urandom of=cache.img bs=64k count=2 conv=notrunc status=none
rm -f "$TEST_DIR/nbd.sock"
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/nbd.sock"
grep -qi superblock <<<"$out" || fail "serve with both superblock copies destroyed: message lacks 'superblock': $out"
log "serve refused corrupt superblock: $(head -c 300 <<<"$out")"
# Zeroed superblock (e.g. a wiped device) is refused as well.
dd if=/dev/zero of=cache.img bs=64k count=2 conv=notrunc status=none
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/nbd.sock"
grep -Eqi 'superblock|not an ssdcache|magic' <<<"$out" || fail "serve on a zeroed cache: unclear message: $out"
expect_fail_stderr "info on a corrupt cache" 'superblock|magic|not an ssdcache' \
    "$SSDCACHE_BIN" info --cache cache.img

# ---- wrong backing ----
mk_sparse disk-d.img 512M
mk_sparse cd.img 64M
create_cache cd.img disk-d.img --name vold
start_server "$TEST_DIR/nbd-d.sock" --cache cd.img
qio "$(nbd_uri "$SOCK")" "write -P 0x42 0 1M" >/dev/null
stop_server
# Same file, different size.
truncate -s 256M disk-d.img
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache cd.img --socket "$TEST_DIR/nbd-d.sock"
grep -qi backing <<<"$out" || fail "serve with a resized backing: message does not mention the backing: $out"
log "resized backing refused: $(head -c 300 <<<"$out")"
# A different file at the same path with the same size (created before the old one is removed,
# so it cannot reuse the inode).
truncate -s 512M disk-d.new
rm -f disk-d.img
mv disk-d.new disk-d.img
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache cd.img --socket "$TEST_DIR/nbd-d.sock"
grep -qi backing <<<"$out" || fail "serve with a replaced backing: message does not mention the backing: $out"
log "replaced backing refused: $(head -c 300 <<<"$out")"
# Two caches created for the same backing: only one may serve it at a time.
mk_sparse disk-e.img 256M
mk_sparse ce1.img 32M
mk_sparse ce2.img 32M
create_cache ce1.img disk-e.img --name vole1
create_cache ce2.img disk-e.img --name vole2
start_server "$TEST_DIR/nbd-e1.sock" --cache ce1.img
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache ce2.img --socket "$TEST_DIR/nbd-e2.sock"
grep -Eqi 'in use|lock|running|busy' <<<"$out" || fail "second cache on a backing in use: unclear message: $out"
log "second cache on a backing already being served refused: $(head -c 300 <<<"$out")"
assert_server_alive
stop_server

# A cache file that shrank after create (e.g. truncated / wrong partition) is refused.
mk_sparse disk-f.img 256M
mk_sparse cf.img 64M
create_cache cf.img disk-f.img --name volf
truncate -s 32M cf.img
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache cf.img --socket "$TEST_DIR/nbd-f.sock"
log "shrunken cache refused: $(head -c 300 <<<"$out")"
grep -Eqi 'size|small|short|truncat|layout|superblock|cache' <<<"$out" || fail "shrunken cache: unclear message: $out"

# A directory as cache is refused by create.
mkdir -p adir
expect_fail_stderr "directory as cache" '.' "$SSDCACHE_BIN" create --cache adir --backing disk-f.img
# An unknown mode is a usage error (exit 2 by the CLI's convention).
rc=0; out=$("$SSDCACHE_BIN" create --cache cf.img --backing disk-f.img --mode write-back-maybe --force 2>&1) || rc=$?
[[ $rc -ne 0 ]] || fail "create accepted --mode write-back-maybe"
log "unknown mode refused (status $rc): $(head -c 200 <<<"$out")"

# Backing gone entirely.
rm -f disk-d.img
expect_fail_run out 30 "$SSDCACHE_BIN" serve --cache cd.img --socket "$TEST_DIR/nbd-d.sock"
grep -qi backing <<<"$out" || fail "serve with a missing backing: message does not mention the backing: $out"
log "ok"
