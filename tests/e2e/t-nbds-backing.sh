#!/usr/bin/env bash
# A backing export reached over TLS (issue 13 item 5, nbds://): qemu-nbd serves a raw image on
# 127.0.0.1 with x509 certificates (tls-creds-x509, which also asks for a client certificate);
# ssdcache caches it write-back through `nbds://127.0.0.1:PORT/disk?tls-certificates=DIR`.
#  1. Refused, naming why: a server certificate from a CA the folder does not hold, the
#     plaintext nbd:// URI to the TLS-only server, `tls-verify-peer=0`, a relative folder;
#     later a plaintext `--backing NAME=nbd://` override of the TLS volume.
#  2. create over TLS; 24 MiB written through the cache; the store killed (SIGKILL) and
#     restarted under a second writer: the daemon reconnects over TLS and the writer sees no
#     error; `ssdcache flush`; the store's image equals what was written, byte for byte.
source "$(dirname "$0")/lib.sh"
require_tool openssl qemu-nbd qemu-io nbdinfo nbdcopy jq timeout cmp python3
require_bin

make_certs "$TEST_DIR/pki" "store CA"
make_certs "$TEST_DIR/other" "another CA"
PKI=$TEST_DIR/pki
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
STORE_URI="nbds://127.0.0.1:$PORT/disk?tls-certificates=$PKI"
STORE_PID=""

start_store() {
    qemu-nbd -f raw -x disk -D store-tls -t -e 8 --cache=writeback -b 127.0.0.1 -p "$PORT" \
        --object "tls-creds-x509,id=tls0,endpoint=server,dir=$PKI" --tls-creds tls0 \
        "$TEST_DIR/store.raw" >>"$TEST_DIR/store.log" 2>&1 &
    STORE_PID=$!
    _PIDS+=("$STORE_PID")
    local i
    for ((i = 0; i < 100; i++)); do
        timeout 5 nbdinfo --size "$STORE_URI" >/dev/null 2>&1 && return 0
        _is_ours_alive "$STORE_PID" || fail "qemu-nbd exited; log: $(cat "$TEST_DIR/store.log")"
        sleep 0.1
    done
    fail "qemu-nbd with TLS did not come up within 10 s; log: $(cat "$TEST_DIR/store.log")"
}
stop_store() { # stop_store [SIGNAL]
    kill -"${1:-TERM}" "$STORE_PID"
    _wait_gone "$STORE_PID" 20 || fail "qemu-nbd $STORE_PID did not exit"
    wait "$STORE_PID" 2>/dev/null || true
}

mk_sparse store.raw 128M
mk_sparse cache.img 64M
start_store

# --- 1. refusals ---
expect_status 1 "a server certificate from another CA" "TLS handshake.*certificate" \
    "$SSDCACHE_BIN" create --cache cache.img \
    --backing "nbds://127.0.0.1:$PORT/disk?tls-certificates=$TEST_DIR/other"
expect_status 1 "plaintext to the TLS-only store" "TLS" \
    "$SSDCACHE_BIN" create --cache cache.img --backing "nbd://127.0.0.1:$PORT/disk"
expect_status 2 "tls-verify-peer=0" "always verifies" \
    "$SSDCACHE_BIN" create --cache cache.img --backing "$STORE_URI&tls-verify-peer=0"
expect_status 2 "a relative certificates folder" "absolute path" \
    "$SSDCACHE_BIN" create --cache cache.img \
    --backing "nbds://127.0.0.1:$PORT/disk?tls-certificates=pki"

# --- 2. write-back over TLS, the store restarted under a writer ---
create_cache cache.img "$STORE_URI" --name vol0 --mode write-back
assert_contains "$(ssd info --cache cache.img)" "nbd:disk#store-tls" "the export's identity"
start_server "$TEST_DIR/ssd.sock" --cache cache.img
head -c $((24 << 20)) /dev/urandom >"$TEST_DIR/expected"
truncate -s 128M "$TEST_DIR/expected"
nbdcopy --flush "$TEST_DIR/expected" "$(nbd_uri "$SOCK" vol0)" || fail "nbdcopy to the cache failed"
# The second writer: 16 MiB more at 64 MiB, in 1 MiB writes, while the store dies and returns.
head -c $((16 << 20)) /dev/urandom >"$TEST_DIR/second"
for ((i = 0; i < 16; i++)); do
    dd if="$TEST_DIR/second" of="$TEST_DIR/second-$i" bs=1M skip=$i count=1 status=none
done
(
    for ((i = 0; i < 16; i++)); do
        qemu-io -f raw -c "write -s $TEST_DIR/second-$i $((64 + i))M 1M" "$(nbd_uri "$SOCK" vol0)" || exit 1
        sleep 0.1
    done
) >"$TEST_DIR/writer.log" 2>&1 &
WRITER=$!
_PIDS+=("$WRITER")
sleep 0.5
stop_store KILL
log "store killed with SIGKILL under the writer"
sleep 1
start_store
wait "$WRITER" || fail "the writer failed while the store restarted: $(cat "$TEST_DIR/writer.log")"
dd if="$TEST_DIR/second" of="$TEST_DIR/expected" bs=1M seek=64 conv=notrunc status=none
for ((i = 0; i < 600; i++)); do
    grep -q "reconnected to the backing export" "$SERVER_LOG" && break
    sleep 0.1
done
grep -q "reconnected to the backing export" "$SERVER_LOG" ||
    fail "the daemon did not log its reconnection over TLS; log: $(tail -n 20 "$SERVER_LOG")"
ssd flush --cache cache.img >"$TEST_DIR/flush.out" 2>&1 || fail "flush failed: $(cat "$TEST_DIR/flush.out")"
assert_eq "$(vol_field "$(stats_json cache.img)" vol0 dirty_bytes)" 0 "dirty bytes after flush"
stop_server
# Never in plaintext, not even through an override (review 50).
expect_status 2 "a plaintext override of a TLS volume" "created with its export reached over TLS" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/ssd2.sock" \
    --backing "vol0=nbd://127.0.0.1:$PORT/disk"
stop_store
cmp "$TEST_DIR/expected" "$TEST_DIR/store.raw" ||
    fail "the store's image differs from what was written through the cache"
log "the store's image equals what was written, byte for byte"
log "PASS"
