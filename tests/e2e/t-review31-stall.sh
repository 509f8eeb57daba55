#!/usr/bin/env bash
# Review 31, F3: with ring reads, a connection whose client stops reading replies keeps the
# line locks of its completed-but-unreaped hits until its I/O timeout: another client's read
# and write of one of those lines wait that long. (Before the ring, a worker released the
# lines before it blocked sending.)
source "$(dirname "$0")/lib.sh"
require_tool python3 qemu-io truncate timeout
require_bin
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-through
start_server "$TEST_DIR/nbd.sock" --cache cache.img --io-timeout 10
# Warm lines 0..127 (64 KiB lines by default): each read twice, in pieces.
qio "$(nbd_uri "$SOCK")" "read 0 8M" >/dev/null
qio "$(nbd_uri "$SOCK")" "read 0 8M" >/dev/null
out=$(timeout 60 python3 "$E2E_DIR/review31_stall.py" "$SOCK" 65536 128 read)
log "$out"
read_s=$(awk '/^B read/ { print $3 }' <<<"$out")
out=$(timeout 60 python3 "$E2E_DIR/review31_stall.py" "$SOCK" 65536 128 write)
log "$out"
write_s=$(awk '/^B write/ { print $3 }' <<<"$out")
stop_server
awk -v r="$read_s" -v w="$write_s" 'BEGIN { exit !(r < 2 && w < 2) }' ||
    fail "another client's read took ${read_s} s and write ${write_s} s: they waited for the stalled client's I/O timeout"
