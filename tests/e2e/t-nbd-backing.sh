#!/usr/bin/env bash
# A backing device reached over NBD (issue 13 item 5): qemu-nbd serves a raw image (the
# "store"); ssdcache caches it write-back.
#  1. create records the export (URI, size, "nbd:NAME#DESCRIPTION") as the volume's identity.
#  2. ext4 on the cached device (nbdfuse + loop); while a writer fills it, the store is killed
#     with SIGKILL and restarted: ssdcache reconnects, the writer sees no error.
#  3. `ssdcache flush`; the device read whole through ssdcache equals the image read back
#     through the store alone (qemu-nbd stopped: the raw file itself), which fscks clean with
#     every file intact.
#  4. Safe assembly: an export without a description is refused unless --trust-export-name; a
#     second cache on an export a daemon uses is refused (host-wide lock); another export at
#     the address (another description) is refused; a store that is not there is named in the
#     error. A second export added and removed online as a volume.
source "$(dirname "$0")/lib.sh"
require_tool qemu-nbd nbdfuse nbdcopy fusermount3 losetup mkfs.ext4 fsck.ext4 mount umount \
    sha256sum jq timeout cmp findmnt
require_bin
[[ -e /dev/fuse ]] || fail "/dev/fuse missing"

STORE_SOCK="$TEST_DIR/store.sock"
STORE_URI="nbd+unix:///disk?socket=$STORE_SOCK"
STORE_PID=""

# start_store DESCRIPTION: qemu-nbd on the image, persistent, 8 clients (multi-conn).
start_store() {
    rm -f "$STORE_SOCK"
    qemu-nbd -f raw -x disk -D "$1" -t -e 8 --cache=writeback -k "$STORE_SOCK" \
        "$TEST_DIR/store.raw" >>"$TEST_DIR/store.log" 2>&1 &
    STORE_PID=$!
    _PIDS+=("$STORE_PID")
    local i
    for ((i = 0; i < 100; i++)); do
        [[ -S "$STORE_SOCK" ]] && timeout 5 nbdinfo --size "$STORE_URI" >/dev/null 2>&1 && return 0
        _is_ours_alive "$STORE_PID" || fail "qemu-nbd exited; log: $(cat "$TEST_DIR/store.log")"
        sleep 0.1
    done
    fail "qemu-nbd did not come up within 10 s"
}
stop_store() { # stop_store [SIGNAL]
    kill -"${1:-TERM}" "$STORE_PID"
    _wait_gone "$STORE_PID" 20 || fail "qemu-nbd $STORE_PID did not exit"
    wait "$STORE_PID" 2>/dev/null || true
}

mk_sparse store.raw 512M
mk_sparse cache.img 128M
start_store store-1

# --- 1. create with a URI ---
# A second store whose export has no description: refused unless trusted by name.
mk_sparse other.raw 64M
OTHER_SOCK="$TEST_DIR/other.sock"
OTHER_URI="nbd+unix:///other?socket=$OTHER_SOCK"
qemu-nbd -f raw -x other -t -e 8 -k "$OTHER_SOCK" "$TEST_DIR/other.raw" >>"$TEST_DIR/other.log" 2>&1 &
OTHER_PID=$!
_PIDS+=("$OTHER_PID")
for ((i = 0; i < 100; i++)); do
    timeout 5 nbdinfo --size "$OTHER_URI" >/dev/null 2>&1 && break
    sleep 0.1
done
mk_sparse scratch.img 64M
expect_status 1 "an export without a description" "no description.*--trust-export-name" \
    "$SSDCACHE_BIN" create --cache scratch.img --backing "$OTHER_URI"
expect_status 2 "a relative socket path" "absolute path" \
    "$SSDCACHE_BIN" create --cache scratch.img --backing "nbd+unix:///disk?socket=store.sock"
expect_status 2 "TLS to the export without certificates" "tls-certificates=DIR" \
    "$SSDCACHE_BIN" create --cache scratch.img --backing "nbds://127.0.0.1/disk"
create_cache cache.img "$STORE_URI" --name vol0 --mode write-back
info=$(ssd info --cache cache.img)
assert_contains "$info" "nbd:disk#store-1" "info shows the export's recorded identity"
assert_contains "$info" "$STORE_URI" "info shows the export's URI"

# --- 2. ext4 through the cache while the store restarts ---
start_server "$TEST_DIR/ssd.sock" --cache cache.img
MNT="$TEST_DIR/mnt"
nbdfuse_attach "$TEST_DIR/fuse" "$(nbd_uri "$SOCK" vol0)"
loop_attach "$FUSE_FILE"
mkfs.ext4 -q -F "$LOOP_DEV" || fail "mkfs.ext4 failed"
do_mount "$LOOP_DEV" "$MNT"
make_tree "$MNT/a" 1
sync -f "$MNT"

# A writer fills tree b; the store dies (SIGKILL) under it and comes back 1 s later.
(make_tree "$MNT/b" 2 && sync -f "$MNT") >"$TEST_DIR/writer.log" 2>&1 &
WRITER=$!
_PIDS+=("$WRITER")
sleep 1
stop_store KILL
log "store killed with SIGKILL under the writer"
sleep 1
start_store store-1
log "store restarted"
wait "$WRITER" || fail "the writer failed while the store restarted: $(cat "$TEST_DIR/writer.log")"
# A read miss and a flush of the backing device both go over the new connection.
( cd "$MNT" && find a b -type f -print0 | sort -z | xargs -0 sha256sum ) >"$TEST_DIR/sums"
assert_gt "$(wc -l <"$TEST_DIR/sums")" 400 "files checksummed"
# Write-back absorbed the writer's data and FLUSHes without the store, so the writer may end
# before the reconnection does (Ceph releases a dead client's image lock after ~30 s).
for ((i = 0; i < 120 * 10; i++)); do
    grep -q "reconnected to the backing export" "$SERVER_LOG" && break
    sleep 0.1
done
grep -q "reconnected to the backing export" "$SERVER_LOG" ||
    fail "the daemon did not log its reconnection; log: $(tail -n 20 "$SERVER_LOG")"
assert_server_alive
# One export, one cache: a second cache on the export the daemon uses is refused.
expect_status 1 "a second cache on the same export" "another ssdcache process on this host" \
    "$SSDCACHE_BIN" create --cache scratch.img --backing "$STORE_URI" --force
# The undescribed export, trusted by name, added and removed while serving.
out=$(ssd volume add --cache cache.img --backing "$OTHER_URI" --name vol1 --mode write-back \
    --trust-export-name 2>&1) || fail "volume add of an export while serving failed: $out"
assert_eq "$(nbdinfo --size "$(nbd_uri "$SOCK" vol1)")" $((64 << 20)) "size of the added export"
qemu-io -f raw -c "write -P 0x5a 0 1M" "$(nbd_uri "$SOCK" vol1)" >/dev/null ||
    fail "write to the added export failed"
# The same export spelt another way (review 48) is still the same export.
expect_status 1 "the same export added twice" "already the backing device|another ssdcache" \
    "$SSDCACHE_BIN" volume add --cache cache.img --name vol2 --trust-export-name \
    --backing "nbd+unix:///other?socket=$TEST_DIR//other.sock"
out=$(ssd volume remove --cache cache.img --name vol1 2>&1) ||
    fail "volume remove of the added export failed: $out"
out=$(qemu-io -f raw -c "read -P 0x5a 0 1M" "$OTHER_URI" 2>&1)
[[ $out == *"read 1048576/1048576"* && $out != *"verification failed"* ]] ||
    fail "the removed volume's data is not on its export: $out"
kill "$OTHER_PID"; _wait_gone "$OTHER_PID" 20 || fail "qemu-nbd $OTHER_PID did not exit"

# --- 3. flush, then the store alone holds the device ---
sync -f "$MNT"
do_umount "$MNT"
loop_detach "$LOOP_DEV"
nbdfuse_detach "$TEST_DIR/fuse"
ssd flush --cache cache.img >"$TEST_DIR/flush.out" 2>&1 || fail "flush failed: $(cat "$TEST_DIR/flush.out")"
assert_eq "$(vol_field "$(stats_json cache.img)" vol0 dirty_bytes)" 0 "dirty bytes after flush"
nbdcopy "$(nbd_uri "$SOCK" vol0)" "$TEST_DIR/device.copy" || fail "nbdcopy of the device failed"
stop_server
stop_store
cmp "$TEST_DIR/device.copy" "$TEST_DIR/store.raw" ||
    fail "the image on the store differs from the device served through the cache"
log "the store's image equals the device, byte for byte"
loop_attach "$TEST_DIR/store.raw"
check_fsck "$LOOP_DEV"
do_mount "$LOOP_DEV" "$MNT"
verify_sums "$TEST_DIR/sums"
do_umount "$MNT"
loop_detach "$LOOP_DEV"

# --- 4. safe assembly ---
start_store store-2
expect_status 1 "serve in front of another export" "not the backing device.*store-2" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/ssd2.sock"
stop_store
expect_status 1 "serve with the store away" "cannot use backing device.*$STORE_SOCK" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/ssd2.sock" --backing-wait 1
expect_status 2 "a malformed URI" "not a usable NBD URI" \
    "$SSDCACHE_BIN" create --cache cache.img --backing "nbd+unix:///disk" --force
log "PASS"
