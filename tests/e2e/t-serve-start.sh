#!/usr/bin/env bash
# A start that fails must not turn a warm cache cold (issue #10, item 4), and serve's refusals
# of what a new user got wrong. Every socket, address and volume name is checked before the
# cache is opened (opening marks it running), so each bad start below must exit with the
# documented status (2: bad usage; 1: an error about the environment), say what is wrong,
# create or delete nothing, and leave the cache as it was: state clean, no unclean start
# counted, and the next start warm with the data written before.
source "$(dirname "$0")/lib.sh"
require_tool python3 qemu-io jq truncate timeout
require_bin
M=$((1024 * 1024))

mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-back --sequential-cutoff 0
start_server "$TEST_DIR/nbd.sock" --cache cache.img
qio "$(nbd_uri "$SOCK")" "write -P 0x5c 0 $((8 * M))" >/dev/null
stop_server

# assert_clean WHAT: the superblock says clean and no unclean start was counted.
assert_clean() {
    local info
    info=$(ssd info --cache cache.img --json) || fail "$1: ssdcache info failed: $info"
    assert_eq "$(jq -r .state <<<"$info")" clean "$1: cache state"
    assert_eq "$(jq -r .unclean_starts <<<"$info")" 0 "$1: unclean starts"
}
assert_clean "after the first clean stop"

# bad_start DESC STATUS REGEX SERVE-ARGS...: serve must refuse (bounded) with exit STATUS and an
# error matching REGEX, and leave the cache clean.
bad_start() {
    local desc=$1 want=$2 re=$3 rc=0 out
    shift 3
    out=$(timeout -k 5 30 "$SSDCACHE_BIN" serve --cache cache.img "$@" 2>&1) || rc=$?
    [[ $rc -ne 124 && $rc -ne 137 ]] || fail "$desc: serve did not refuse (still running after 30 s):
$out"
    assert_clean "$desc"
    [[ $rc -eq $want ]] || fail "$desc: exit status $rc, expected $want:
$out"
    grep -Eqi -- "$re" <<<"$out" || fail "$desc: the error does not match /$re/:
$out"
    grep -q 'error' <<<"$out" || fail "$desc: no error message: $out"
    log "$desc: refused with status $rc: $(grep 'error' <<<"$out" | head -c 300)"
}

# A TCP port and a Unix socket another program listens on.
python3 - "$TEST_DIR/busy.sock" >"$TEST_DIR/busy.out" 2>&1 <<'EOF' &
import socket, sys, time
tcp = socket.socket()
tcp.bind(("127.0.0.1", 0))
tcp.listen(8)
unix = socket.socket(socket.AF_UNIX)
unix.bind(sys.argv[1])
unix.listen(8)
print(tcp.getsockname()[1], flush=True)
time.sleep(300)
EOF
BUSY_PID=$!
_PIDS+=("$BUSY_PID")
for ((i = 0; i < 100; i++)); do
    [[ -s "$TEST_DIR/busy.out" ]] && break
    _is_ours_alive "$BUSY_PID" || fail "the busy listener died: $(cat "$TEST_DIR/busy.out")"
    sleep 0.1
done
PORT=$(head -n 1 "$TEST_DIR/busy.out")
[[ "$PORT" =~ ^[0-9]+$ ]] || fail "the busy listener printed no port: $(cat "$TEST_DIR/busy.out")"
A="$TEST_DIR/a.sock"

bad_start "--listen on a port in use" 1 "cannot listen on tcp 127.0.0.1:$PORT" \
    --socket "$A" --listen "127.0.0.1:$PORT"
[[ ! -e "$A" ]] || fail "a refused start left its socket $A behind"
bad_start "--listen not HOST:PORT" 2 'not HOST:PORT' --socket "$A" --listen nonsense
bad_start "NBD socket in use" 1 'in use by a running server' --socket "$TEST_DIR/busy.sock"
[[ -S "$TEST_DIR/busy.sock" ]] || fail "the other program's socket was removed"
bad_start "control socket in use" 1 'in use by a running server' \
    --socket "$A" --control "$TEST_DIR/busy.sock"
bad_start "unwritable socket path" 1 'cannot listen on /proc/' --socket /proc/ssdcache-e2e.sock
bad_start "socket in a missing directory" 1 'directory .*/no/such/dir does not exist' \
    --socket "$TEST_DIR/no/such/dir/s.sock"
[[ ! -e "$TEST_DIR/no" ]] || fail "serve created the missing directories"
echo keep >"$TEST_DIR/regular"
bad_start "a file where the socket goes" 1 'exists and is not a socket' --socket "$TEST_DIR/regular"
assert_eq "$(cat "$TEST_DIR/regular")" keep "the file at the socket path"
bad_start "--backing naming no volume" 2 'no volume named "nosuch".*its volumes: vol0' \
    --socket "$A" --backing "nosuch=$TEST_DIR/backing.img"
printf '[backing]\nnosuch = "%s"\n' "$TEST_DIR/backing.img" >"$TEST_DIR/bad.toml"
bad_start "[backing] naming no volume" 2 'no volume named "nosuch"' \
    --socket "$A" --config "$TEST_DIR/bad.toml"
bad_start "--connection-memory below one request" 2 'connection-memory' \
    --socket "$A" --connection-memory 1MiB
bad_start "--io-timeout 0" 2 'io-timeout' --socket "$A" --io-timeout 0
bad_start "--max-connections 0" 2 'max-connections' --socket "$A" --max-connections 0

# After all of that the cache is still warm and holds the data.
start_server "$TEST_DIR/nbd.sock" --cache cache.img
grep -Eq 'cache warm: [1-9][0-9]* lines' "$SERVER_LOG" || fail "the cache did not start warm:
$(cat "$SERVER_LOG")"
qio "$(nbd_uri "$SOCK")" "read -P 0x5c 0 $((8 * M))" >/dev/null
stop_server
assert_clean "at the end"
log "ok: 13 bad starts refused before the cache was opened; the cache stayed warm"
