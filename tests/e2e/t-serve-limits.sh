#!/usr/bin/env bash
# The NBD server's limits with the real daemon (issue #10, item 6; docs/design.md §6.1):
#   * --max-connections: a client beyond it is closed before the greeting, the refusal is
#     logged, and a place that frees up can be taken again;
#   * request memory: 32 pipelined 32 MiB reads on one connection (32 workers) pin at most the
#     connection's 64 MiB of buffers, not 32 x 32 MiB (the daemon's peak resident memory is
#     measured);
#   * a client that sends 51,200 reads before it reads any reply is served (issue 13 item 2);
#   * --idle-timeout: a session that asks nothing is closed after it.
source "$(dirname "$0")/lib.sh"
require_tool python3 nbdinfo qemu-io truncate timeout
require_bin
STALL="$E2E_DIR/nbd_stall.py"
[[ -r "$STALL" ]] || fail "missing $STALL"
M=$((1024 * 1024))

mk_sparse backing.img 1G
mk_sparse cache.img 32M
# Pass-through: reads go straight to the sparse backing file, so the test measures the
# server's buffers, not the cache.
create_cache cache.img backing.img --name vol0 --mode pass-through

# run_helper NAME ARGS...: runs nbd_stall.py in the background; sets HELPER_PID, HELPER_OUT.
run_helper() {
    HELPER_OUT="$TEST_DIR/helper.$1.out"
    shift
    python3 "$STALL" "$SOCK" "$@" >"$HELPER_OUT" 2>&1 &
    HELPER_PID=$!
    _PIDS+=("$HELPER_PID")
}
wait_output() { # wait_output REGEX: bounded wait for the helper to print a line matching REGEX
    local i
    for ((i = 0; i < 300; i++)); do
        grep -Eqs "$1" "$HELPER_OUT" && return 0
        _is_ours_alive "$HELPER_PID" || break
        sleep 0.1
    done
    grep -Eqs "$1" "$HELPER_OUT" || fail "the client helper did not print /$1/: $(cat "$HELPER_OUT")"
}
stop_helper() {
    kill "$HELPER_PID" 2>/dev/null || true
    wait "$HELPER_PID" 2>/dev/null || true
}

# ---- connection limit ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img --max-connections 3
run_helper sessions sessions 5
wait_output '^holding'
grep -q '^opened 3 refused 2' "$HELPER_OUT" || fail "expected 3 sessions and 2 refusals: $(cat "$HELPER_OUT")"
n=$(grep -c 'refusing NBD connection' "$SERVER_LOG" || true)
assert_eq "$n" 2 "refusals in the log"
grep -q '3 connections are open, the server.s limit' "$SERVER_LOG" ||
    fail "the refusal does not say why: $(grep refusing "$SERVER_LOG")"
timeout -k 5 10 nbdinfo --size "$(nbd_uri "$SOCK")" >/dev/null 2>&1 &&
    fail "a fourth client got through while 3 sessions are open"
stop_helper
# The helper's sockets are closed by the kernel; the server notices on its next read. Wait (bounded) for
# the three close lines before connecting, or the fifth client can race the server's bookkeeping.
for ((i = 0; i < 100; i++)); do
    (($(grep -c 'NBD connection closed' "$SERVER_LOG" || true) >= 3)) && break
    sleep 0.1
done
(($(grep -c 'NBD connection closed' "$SERVER_LOG" || true) >= 3)) ||
    fail "the server did not notice the 3 sessions closing within 10 s"
size=$(timeout -k 5 30 nbdinfo --size "$(nbd_uri "$SOCK")") || fail "no client could connect after the sessions closed"
assert_eq "$size" $((1024 * M)) "export size once the places are free"
stop_server
log "--max-connections 3: 2 of 5 sessions refused before the greeting and logged; free again after"

# ---- request memory: one connection, 32 workers, 32 pipelined reads of 32 MiB ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img --threads 32
base=$(awk '/^VmHWM/ { print $2 }' "/proc/$SERVER_PID/status")
run_helper reads reads 32 $((32 * M))
wait_output '^done 32'
peak=$(awk '/^VmHWM/ { print $2 }' "/proc/$SERVER_PID/status")
grown=$(((peak - base) / 1024))
log "32 reads of 32 MiB on one connection: peak resident memory grew by ${grown} MiB (from $((base / 1024)) MiB)"
((grown < 160)) || fail "the daemon's peak memory grew by ${grown} MiB: request buffers are not bounded by the connection's 64 MiB"
qio "$(nbd_uri "$SOCK")" "write -P 3 0 65536" "read -P 3 0 65536" >/dev/null
stop_server

# ---- a client that sends every request before it reads any reply (issue 13 item 2) ----
# 51,200 reads of 1 KiB (1.4 MB of requests, 50 MiB of replies) in one send, then every reply:
# the server reads the requests while their replies wait (before, its workers blocked writing
# replies and it stopped reading, and the client's send never ended: 106 s and more).
start_server "$TEST_DIR/nbd.sock" --cache cache.img
t0=$(date +%s%N)
run_helper pipelined reads 51200 1024
wait_output '^done 51200'
log "51,200 reads of 1 KiB sent before any reply was read: served in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
stop_server

# ---- idle timeout ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img --idle-timeout 1
run_helper idle sessions 1
wait_output '^holding'
for ((i = 0; i < 100; i++)); do
    grep -q 'closing an idle connection' "$SERVER_LOG" && break
    sleep 0.1
done
grep -q 'closing an idle connection' "$SERVER_LOG" || fail "an idle session was not closed: $(cat "$SERVER_LOG")"
stop_helper
stop_server
log "ok: connection limit, request memory bound and idle timeout hold with the real daemon"
