#!/usr/bin/env bash
# Review 31, F1 with the real daemon: a damaged dirty sector in write-back, one client reading
# it (and a sector of the next line) over and over, another writing 8 KiB across the two
# lines. The completion thread's fallback read of the damaged hit can wait for a writer that
# holds the damaged line and waits for the next line, which a hit on the same completion
# thread holds: both clients stop for good, and the daemon cannot stop cleanly.
source "$(dirname "$0")/lib.sh"
require_tool python3 qemu-io truncate timeout dd grep
require_bin
LINE=65536
L=10
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-back
start_server "$TEST_DIR/nbd.sock" --cache cache.img
# Dirty data in lines L and L+1, the damaged sector with a marker to find it in cache.img.
qio "$(nbd_uri "$SOCK")" "write -P 7 $((L * LINE)) $((2 * LINE))" >/dev/null
printf 'REVIEW31-MARKER-%s' {1..200} | head -c 4096 >marker.bin
qemu-io -f raw -c "write -s marker.bin $((L * LINE)) 4096" "$(nbd_uri "$SOCK")" >/dev/null
sync
at=$(dd if=cache.img iflag=direct bs=1M status=none | grep -boa 'REVIEW31-MARKER-1R' | head -1 | cut -d: -f1)
[[ -n "$at" ]] || fail "the marker is not in cache.img"
log "damaged sector at byte $at of cache.img"
head -c 4096 /dev/urandom >junk.bin
dd if=junk.bin of=cache.img oflag=direct conv=notrunc bs=4096 seek=$((at / 4096)) count=1 status=none
# 30 s of racing, not the review's 150 s, to fit CI; the engine test
# waiting_for_ring_hits_never_waits_for_a_line pins the mechanism without timing.
out=$(timeout 80 python3 "$E2E_DIR/review31_damage_race.py" "$SOCK" $LINE $L 30)
log "$out"
if grep -q '^stalled' <<<"$out"; then
    if command -v gdb >/dev/null; then
        timeout 60 gdb -p "$SERVER_PID" -batch -ex "thread apply all bt 30" >"$TEST_DIR/gdb.txt" 2>/dev/null || true
        grep -E '^Thread|ssdcache_(engine|nbd)::' "$TEST_DIR/gdb.txt" | sed -E 's/ \(.*\) at / at /; s/0x[0-9a-f]+ in //' |
            grep -E -A8 'nbd-completer|nbd-slow-worker|nbd-worker' | grep -E '^Thread|lock_range|Volume::|RingHits|Connection::(serve|execute|ring_completer|serve_read_batch)' >"$TEST_DIR/stacks.txt" || true
        log "server stacks (threads waiting for a line lock):"
        grep -B3 -A3 'lock_range' "$TEST_DIR/stacks.txt" | head -40 >&2 || true
    fi
    # The daemon cannot stop cleanly either: SIGTERM, then the stop's bound.
    kill -TERM "$SERVER_PID"
    if _wait_gone "$SERVER_PID" 200; then
        rc=0; wait "$SERVER_PID" || rc=$?
        log "the daemon exited with status $rc after SIGTERM: $(grep -E 'still inside|still busy|closing every' "$SERVER_LOG" | tail -3)"
    else
        log "the daemon did not exit within 200 s of SIGTERM"
    fi
    fail "the clients stopped getting replies: $out"
fi
stop_server
