#!/usr/bin/env bash
# NBD over TLS (issue 13 item 4): `serve --tls require` with x509 certificates made here by
# openssl. Real clients over TLS: nbdinfo and nbdcopy (libnbd, nbds+unix://), qemu-io and
# qemu-img (qemu's tls-creds-x509), and ext4 on nbdfuse + loop through qemu-nbd as the TLS
# client; a plaintext client refused;
# a client that does not trust the server's CA refused (qemu with tls-hostname over the Unix
# socket, libnbd over TCP on 127.0.0.1); with --tls-verify-peer, a client certificate from
# another CA refused by the server; bad TLS flags and unreadable credentials are bad usage (2,
# naming the file); `--tls on` keeps plaintext clients working.
source "$(dirname "$0")/lib.sh"
require_tool openssl nbdinfo nbdcopy qemu-io qemu-img qemu-nbd nbdfuse fusermount3 losetup \
    mkfs.ext4 fsck.ext4 mount umount sha256sum cmp python3
require_bin
[[ -e /dev/fuse ]] || fail "/dev/fuse missing"

make_certs "$TEST_DIR/pki" "ssdcache test CA"
make_certs "$TEST_DIR/other" "another CA"
PKI=$TEST_DIR/pki

mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-back
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

# ---- bad usage and bad credentials ----
expect_status 2 "--tls on without certificates" "tls-certificates" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --tls on
expect_status 2 "--tls-certificates without --tls" "--tls on or --tls require" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --tls-certificates "$PKI"
expect_status 2 "an unknown --tls mode" "invalid value" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --tls maybe
mkdir -p "$TEST_DIR/nokey" && cp "$PKI/server-cert.pem" "$TEST_DIR/nokey/"
rc=0; out=$(ssd serve --cache cache.img --socket "$TEST_DIR/x.sock" --tls on \
    --tls-certificates "$TEST_DIR/nokey" 2>&1) || rc=$?
assert_eq "$rc" 2 "exit status with no server-key.pem (a bad --tls-certificates, as a bad --config)"
assert_contains "$out" "server-key.pem" "the error names the missing key"

# ---- TLS required ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img --listen "127.0.0.1:$port" \
    --tls require --tls-certificates "$PKI"
TLS_URI="nbds+unix:///vol0?socket=$SOCK&tls-certificates=$PKI"
out=$(timeout 30 nbdinfo "$TLS_URI" 2>&1) || fail "nbdinfo over TLS failed: $out"
assert_contains "$out" "with TLS" "nbdinfo's protocol line"
rc=0; out=$(timeout 30 nbdinfo "$(nbd_uri "$SOCK" vol0)" 2>&1) || rc=$?
[[ $rc -ne 0 ]] || fail "a plaintext client was served with --tls require: $out"
log "plaintext refused: $(head -c 200 <<<"$out")"
for ((i = 0; i < 100; i++)); do # the TCP listener may come up just after the Unix socket
    timeout 10 nbdinfo --size "nbds://127.0.0.1:$port/vol0?tls-certificates=$PKI" >/dev/null 2>&1 && break
    sleep 0.1
done
assert_eq "$(timeout 30 nbdinfo --size "nbds://127.0.0.1:$port/vol0?tls-certificates=$PKI")" \
    $((256 << 20)) "size over TLS on TCP"
rc=0; out=$(timeout 30 nbdinfo --size "nbds://127.0.0.1:$port/vol0?tls-certificates=$TEST_DIR/other" 2>&1) || rc=$?
[[ $rc -ne 0 ]] || fail "libnbd accepted a server certificate from a CA it does not trust"
assert_contains "$out" "certificate" "libnbd's refusal"

# qemu-io and qemu-img over TLS (tls-hostname makes qemu verify the certificate on a socket).
qemu_tls() { # qemu_tls TOOL DIR ARGS...: TOOL with a tls-creds-x509 object from DIR
    local tool=$1 object="tls-creds-x509,id=tls0,endpoint=client,dir=$2" sub=()
    shift 2
    if [[ $tool == qemu-img ]]; then # the subcommand comes first
        sub=("$1")
        shift
    fi
    timeout -k 5 180 "$tool" "${sub[@]}" --object "$object" "$@"
}
QOPTS="driver=nbd,path=$SOCK,export=vol0,tls-creds=tls0,tls-hostname=localhost"
out=$(qemu_tls qemu-io "$PKI" --image-opts "$QOPTS" -c "write -P 0x5a 512 1536" \
    -c "write -P 0xa5 1M 64k" -c "read -P 0x5a 512 1536" -c "read -P 0xa5 1M 64k" 2>&1) ||
    fail "qemu-io over TLS failed: $out"
grep -Eqi 'fail|error|mismatch' <<<"$out" && fail "qemu-io over TLS: $out"
rc=0; out=$(qemu_tls qemu-img "$TEST_DIR/other" info --image-opts "$QOPTS" 2>&1) || rc=$?
[[ $rc -ne 0 ]] || fail "qemu accepted a server certificate from a CA it does not trust"
log "qemu refused the untrusted server: $(head -c 200 <<<"$out")"

# nbdcopy and qemu-img convert read the same image over TLS.
timeout -k 5 180 nbdcopy "$TLS_URI" copy.raw || fail "nbdcopy over TLS failed"
qemu_tls qemu-img "$PKI" convert --image-opts "$QOPTS" -O raw converted.raw ||
    fail "qemu-img convert over TLS failed"
cmp copy.raw converted.raw || fail "nbdcopy and qemu-img convert over TLS differ"

# ext4 over TLS. nbdfuse (libnbd) will not load certificates named in a URI, so qemu-nbd is
# the TLS client here: it reaches ssdcache over TLS (verifying its certificate) and serves the
# disk on a local socket, uncached, flushes passed on; nbdfuse -> loop -> mkfs on that.
FUSEDIR="$TEST_DIR/fuse" MNT="$TEST_DIR/mnt"
qemu-nbd --object "tls-creds-x509,id=tls0,endpoint=client,dir=$PKI" --image-opts "$QOPTS" \
    --cache=none --persistent --socket="$TEST_DIR/proxy.sock" \
    >"$TEST_DIR/qemu-nbd.log" 2>&1 &
PROXY_PID=$!
_PIDS+=("$PROXY_PID")
for ((i = 0; i < 100; i++)); do
    timeout 10 nbdinfo --size "$(nbd_uri "$TEST_DIR/proxy.sock")" >/dev/null 2>&1 && break
    _is_ours_alive "$PROXY_PID" || fail "qemu-nbd exited: $(cat "$TEST_DIR/qemu-nbd.log")"
    sleep 0.1
done
nbdfuse_attach "$FUSEDIR" "$(nbd_uri "$TEST_DIR/proxy.sock")"
loop_attach "$FUSE_FILE"
mkfs.ext4 -q -F "$LOOP_DEV" || fail "mkfs.ext4 over TLS failed"
do_mount "$LOOP_DEV" "$MNT"
make_tree "$MNT/tree" 7
checksum_tree tree "$TEST_DIR/tree.sha256"
sync -f "$MNT" 2>/dev/null || sync
do_umount "$MNT"
check_fsck "$LOOP_DEV"
do_mount "$LOOP_DEV" "$MNT"
verify_sums "$TEST_DIR/tree.sha256"
do_umount "$MNT"
loop_detach "$LOOP_DEV"
nbdfuse_detach "$FUSEDIR"
kill "$PROXY_PID"
_wait_gone "$PROXY_PID" 20 || fail "qemu-nbd did not exit"
assert_server_alive
stop_server

# ---- client certificates (--tls-verify-peer) ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img --tls require --tls-certificates "$PKI" \
    --tls-verify-peer
out=$(qemu_tls qemu-io "$PKI" --image-opts "$QOPTS" -c "read -P 0xa5 1M 64k" 2>&1) ||
    fail "a client certificate from the server's CA was refused: $out"
# The stranger trusts both CAs (qemu checks its own certificate against its CAs too), so only
# the server can refuse it.
mkdir -p "$TEST_DIR/stranger"
cat "$PKI/ca-cert.pem" "$TEST_DIR/other/ca-cert.pem" >"$TEST_DIR/stranger/ca-cert.pem"
cp "$TEST_DIR/other/client-cert.pem" "$TEST_DIR/other/client-key.pem" "$TEST_DIR/stranger/"
rc=0; out=$(qemu_tls qemu-img "$TEST_DIR/stranger" info --image-opts "$QOPTS" 2>&1) || rc=$?
[[ $rc -ne 0 ]] || fail "the server accepted a client certificate from a CA it does not trust"
log "the server refused the stranger's certificate: $(head -c 200 <<<"$out")"
mkdir -p "$TEST_DIR/anonymous" && cp "$PKI/ca-cert.pem" "$TEST_DIR/anonymous/"
rc=0; out=$(qemu_tls qemu-img "$TEST_DIR/anonymous" info --image-opts "$QOPTS" 2>&1) || rc=$?
[[ $rc -ne 0 ]] || fail "the server accepted a client without a certificate"
assert_server_alive
stop_server

# ---- TLS offered: plaintext and TLS clients side by side ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img --tls on --tls-certificates "$PKI"
assert_eq "$(timeout 30 nbdinfo --size "$(nbd_uri "$SOCK" vol0)")" $((256 << 20)) "plaintext size"
out=$(timeout 30 nbdinfo "nbds+unix:///vol0?socket=$SOCK&tls-certificates=$PKI" 2>&1) ||
    fail "nbdinfo over TLS (--tls on) failed: $out"
assert_contains "$out" "with TLS" "TLS with --tls on"
timeout -k 5 180 nbdcopy "$(nbd_uri "$SOCK" vol0)" plain-copy.raw || fail "plaintext nbdcopy failed"
timeout -k 5 180 nbdcopy "nbds+unix:///vol0?socket=$SOCK&tls-certificates=$PKI" tls-copy.raw ||
    fail "nbdcopy over TLS (--tls on) failed"
cmp plain-copy.raw tls-copy.raw || fail "plaintext and TLS reads differ"
assert_server_alive
stop_server
