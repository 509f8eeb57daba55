#!/usr/bin/env bash
# A stop is bounded (issue #10, item 5; docs/design.md §6.2):
#   1. a client that sends reads and never reads the replies holds a worker blocked on the
#      socket; SIGTERM waits --shutdown-timeout for it, closes the sockets, writes the cache map
#      and exits 0: the next start is warm;
#   2. a second signal does not wait at all;
#   3. a request stuck inside the engine (a backing device that does not answer: nbdkit's delay
#      filter under nbdfuse) cannot be raced by the cache map: serve commits the journal and
#      exits 1 within the bound, and the next start replays the journal, dirty data intact.
source "$(dirname "$0")/lib.sh"
require_tool python3 qemu-io jq nbdkit nbdfuse fusermount3 truncate timeout
require_bin
STALL="$E2E_DIR/nbd_stall.py"
[[ -r "$STALL" ]] || fail "missing $STALL"
M=$((1024 * 1024))

# stall_client OFFSET: a client that sends reads at OFFSET and never reads the replies
# (256 reads of 1 MiB, more than the socket buffers hold), once it has sent them all.
stall_client() {
    local out="$TEST_DIR/stall.$_SERVE_N.out" i
    python3 "$STALL" "$SOCK" noread 256 "$M" "$1" >"$out" 2>&1 &
    STALL_PID=$!
    _PIDS+=("$STALL_PID")
    for ((i = 0; i < 200; i++)); do
        grep -qs stalled "$out" && return 0
        _is_ours_alive "$STALL_PID" || fail "the stalling client died: $(cat "$out")"
        sleep 0.1
    done
    fail "the stalling client did not start: $(cat "$out")"
}

# exit_within PID SECONDS: waits (bounded) for PID to exit; sets EXIT_STATUS and ELAPSED.
exit_within() {
    local pid=$1 secs=$2 t0=$SECONDS
    _wait_gone "$pid" "$secs" || fail "serve did not exit within ${secs}s; log:
$(cat "$SERVER_LOG")"
    EXIT_STATUS=0
    wait "$pid" || EXIT_STATUS=$?
    ELAPSED=$((SECONDS - t0))
    check_no_panic "$pid"
}

assert_warm_start() {
    grep -Eq 'cache warm: [1-9][0-9]* lines' "$SERVER_LOG" || fail "$1: the cache did not start warm:
$(cat "$SERVER_LOG")"
    local info
    info=$(ssd info --cache cache.img --json)
    assert_eq "$(jq -r .unclean_starts <<<"$info")" 0 "$1: unclean starts"
}

mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-back --sequential-cutoff 0
start_server "$TEST_DIR/nbd.sock" --cache cache.img --shutdown-timeout 3
qio "$(nbd_uri "$SOCK")" "write -P 0x21 0 $((4 * M))" >/dev/null

# ---- 1. one SIGTERM, a client that stopped reading ----
stall_client 0
sleep 1
kill -TERM "$SERVER_PID"
exit_within "$SERVER_PID" 20
assert_eq "$EXIT_STATUS" 0 "exit status after SIGTERM with a stalled client (log: $(tail -n 5 "$SERVER_LOG"))"
((ELAPSED >= 2)) || fail "serve did not wait for the requests in flight (exited after ${ELAPSED}s)"
grep -q 'closing every client socket' "$SERVER_LOG" || fail "no word of the closed sockets: $(cat "$SERVER_LOG")"
grep -q 'stopped cleanly' "$SERVER_LOG" || fail "not a clean stop: $(cat "$SERVER_LOG")"
log "SIGTERM with a client that stopped reading: clean exit in ${ELAPSED}s (--shutdown-timeout 3)"

start_server "$TEST_DIR/nbd.sock" --cache cache.img --shutdown-timeout 300
assert_warm_start "after a stop with a stalled client"
qio "$(nbd_uri "$SOCK")" "read -P 0x21 0 $((4 * M))" >/dev/null

# ---- 2. a second signal does not wait ----
stall_client 0
sleep 1
kill -TERM "$SERVER_PID"
sleep 1.5
assert_server_alive
t0=$SECONDS
SERVER_STOP_TIMEOUT=5 stop_server "$SERVER_PID" INT
grep -q 'again: closing every client socket without waiting' "$SERVER_LOG" ||
    fail "no word of the second signal: $(cat "$SERVER_LOG")"
log "second signal: clean exit in $((SECONDS - t0))s although --shutdown-timeout is 300"

start_server "$TEST_DIR/nbd.sock" --cache cache.img
assert_warm_start "after a double signal"
qio "$(nbd_uri "$SOCK")" "read -P 0x21 0 $((4 * M))" >/dev/null
stop_server

# ---- 3. a request stuck inside the engine ----
# Reads of the backing device take 15 s: longer than the stop's bound here (2 s for requests,
# 2 s for the sockets' threads, then the commit).
nbdkit -f -U "$TEST_DIR/slow.sock" --filter=delay memory 256M rdelay=15 >"$TEST_DIR/nbdkit.log" 2>&1 &
_PIDS+=("$!")
for ((i = 0; i < 100; i++)); do
    [[ -S "$TEST_DIR/slow.sock" ]] && break
    sleep 0.1
done
[[ -S "$TEST_DIR/slow.sock" ]] || fail "nbdkit did not start: $(cat "$TEST_DIR/nbdkit.log")"
nbdfuse_attach "$TEST_DIR/fuse" "nbd+unix:///?socket=$TEST_DIR/slow.sock"
SLOW_BACKING=$FUSE_FILE
mk_sparse slow-cache.img 64M
create_cache slow-cache.img "$SLOW_BACKING" --name slow --mode write-back --sequential-cutoff 0
start_server "$TEST_DIR/slow.nbd.sock" --cache slow-cache.img --shutdown-timeout 2
qio "$(nbd_uri "$SOCK")" "write -P 0x42 0 $((4 * M))" >/dev/null
stall_client $((128 * M))
sleep 1
kill -TERM "$SERVER_PID"
t0=$SECONDS
# serve decides within its bound; the process itself can only end once the kernel lets its
# threads waiting in the device read go (uninterruptible), when the read returns.
for ((i = 0; i < 100; i++)); do
    grep -q 'error: stopped without writing the cache map' "$SERVER_LOG" && break
    sleep 0.1
done
decided=$((SECONDS - t0))
grep -q 'error: stopped without writing the cache map' "$SERVER_LOG" ||
    fail "serve did not give up on the stuck request within 10 s: $(cat "$SERVER_LOG")"
grep -q 'still inside the engine' "$SERVER_LOG" || fail "no word of the stuck request: $(cat "$SERVER_LOG")"
grep -q 'journal committed' "$SERVER_LOG" || fail "the journal was not committed: $(cat "$SERVER_LOG")"
grep -q 'next start replays the journal' "$SERVER_LOG" || fail "no word of what happens next: $(cat "$SERVER_LOG")"
exit_within "$SERVER_PID" 40
assert_eq "$EXIT_STATUS" 1 "exit status with a request stuck in the engine"
state=$(ssd info --cache slow-cache.img --json | jq -r .state)
[[ $state == running* ]] || fail "the cache map was written while a request was stuck (state: $state)"
log "SIGTERM with a request stuck in the engine: journal committed and exit 1 decided in ${decided}s (the process ended when the read returned)"

start_server "$TEST_DIR/slow.nbd.sock" --cache slow-cache.img
grep -Eq 'recovered after an unclean stop: 64 dirty lines' "$SERVER_LOG" ||
    fail "the journal was not replayed: $(cat "$SERVER_LOG")"
qio "$(nbd_uri "$SOCK")" "read -P 0x42 0 $((4 * M))" >/dev/null
stop_server
log "ok: bounded stops; warm after a stalled client and a double signal; journal replayed after a stuck request"
