#!/usr/bin/env bash
# ssdcache in front of a real distributed block store (issue 13): a single-node Ceph cluster
# (Debian's ceph 16: one monitor, one manager, one bluestore OSD on a sparse file; started by
# tests/e2e/ceph/start.sh, no systemd) with an RBD image exported over NBD by qemu-nbd through
# qemu's rbd driver, with librbd's write-back cache on (--cache=writeback).
#  1. create a write-back cache with the export as backing device (identity: its description
#     names the cluster's fsid).
#  2. ext4 on the cached device (nbdfuse + loop); while a writer fills it, qemu-nbd is killed
#     with SIGKILL (librbd's cache dies with it) and restarted: ssdcache reconnects and sends
#     again what the dead server had not flushed; the writer sees no error.
#  3. `ssdcache flush`, then the image read back through the store alone (ssdcache stopped:
#     qemu-nbd's export straight from RBD) equals the device byte for byte, and fscks clean
#     with every file intact.
source "$(dirname "$0")/lib.sh"
require_tool ceph ceph-mon ceph-mgr ceph-osd ceph-authtool monmaptool rbd uuidgen ss qemu-nbd \
    nbdinfo nbdfuse nbdcopy fusermount3 losetup mkfs.ext4 fsck.ext4 mount umount sha256sum jq \
    timeout cmp findmnt
require_bin
[[ -e /dev/fuse ]] || fail "/dev/fuse missing"
[[ -e /usr/lib/x86_64-linux-gnu/qemu/block-rbd.so ]] ||
    fail "qemu's rbd driver is missing (qemu-block-extra matching qemu-utils: scripts/install-deps)"

CEPH="$E2E_DIR/ceph"
CLUSTER="$TEST_DIR/ceph"
# Every process the cluster scripts started (DIR/pids) is this test's: the cleanup stops them.
adopt_cluster_pids() {
    local name pid
    while read -r name pid; do
        [[ -n "$pid" ]] && _PIDS+=("$pid")
    done <"$CLUSTER/pids"
}
log "starting a single-node Ceph cluster in $CLUSTER"
STORE_URI=$(IMAGE_SIZE=512M "$CEPH/start.sh" "$CLUSTER" 2>"$TEST_DIR/ceph-start.log" | tail -n 1) || {
    adopt_cluster_pids 2>/dev/null || true
    fail "the Ceph cluster did not start: $(tail -n 30 "$TEST_DIR/ceph-start.log")"
}
adopt_cluster_pids
log "Ceph up; RBD image exported at $STORE_URI"
assert_contains "$(nbdinfo "$STORE_URI")" "ceph " "the export's description (the cluster's fsid)"

mk_sparse cache.img 128M
create_cache cache.img "$STORE_URI" --name vol0 --mode write-back
assert_contains "$(ssd info --cache cache.img)" "nbd:disk#ceph " "the recorded identity"

start_server "$TEST_DIR/ssd.sock" --cache cache.img
MNT="$TEST_DIR/mnt"
nbdfuse_attach "$TEST_DIR/fuse" "$(nbd_uri "$SOCK" vol0)"
loop_attach "$FUSE_FILE"
mkfs.ext4 -q -F "$LOOP_DEV" || fail "mkfs.ext4 failed"
do_mount "$LOOP_DEV" "$MNT"
make_tree "$MNT/a" 11
sync -f "$MNT"

(make_tree "$MNT/b" 12 && sync -f "$MNT") >"$TEST_DIR/writer.log" 2>&1 &
WRITER=$!
_PIDS+=("$WRITER")
sleep 1
log "killing qemu-nbd (SIGKILL: librbd's cache is lost) under the writer, and starting it again"
"$CEPH/restart-nbd.sh" "$CLUSTER" KILL >/dev/null 2>"$TEST_DIR/restart.log" ||
    fail "qemu-nbd did not come back: $(cat "$TEST_DIR/restart.log")"
adopt_cluster_pids
wait "$WRITER" || fail "the writer failed while the store's export restarted: $(cat "$TEST_DIR/writer.log")"
( cd "$MNT" && find a b -type f -print0 | sort -z | xargs -0 sha256sum ) >"$TEST_DIR/sums"
assert_gt "$(wc -l <"$TEST_DIR/sums")" 400 "files checksummed"
# Write-back absorbed the writer's data and FLUSHes without the store, so the writer may end
# before the reconnection does (Ceph releases a dead client's image lock after ~30 s).
for ((i = 0; i < 180 * 10; i++)); do
    grep -q "reconnected to the backing export" "$SERVER_LOG" && break
    sleep 0.1
done
grep -q "reconnected to the backing export" "$SERVER_LOG" ||
    fail "the daemon did not reconnect; log: $(tail -n 20 "$SERVER_LOG")"
assert_server_alive

sync -f "$MNT"
do_umount "$MNT"
loop_detach "$LOOP_DEV"
nbdfuse_detach "$TEST_DIR/fuse"
ssd flush --cache cache.img >"$TEST_DIR/flush.out" 2>&1 || fail "flush failed: $(cat "$TEST_DIR/flush.out")"
assert_eq "$(vol_field "$(stats_json cache.img)" vol0 dirty_bytes)" 0 "dirty bytes after flush"
nbdcopy "$(nbd_uri "$SOCK" vol0)" "$TEST_DIR/device.copy" || fail "nbdcopy of the device failed"
stop_server

# The store alone: a fresh qemu-nbd straight on the RBD image (no ssdcache anywhere).
"$CEPH/restart-nbd.sh" "$CLUSTER" TERM >/dev/null 2>"$TEST_DIR/restart.log" ||
    fail "qemu-nbd did not come back: $(cat "$TEST_DIR/restart.log")"
adopt_cluster_pids
nbdcopy "$STORE_URI" "$TEST_DIR/store.copy" || fail "nbdcopy of the RBD image failed"
cmp "$TEST_DIR/device.copy" "$TEST_DIR/store.copy" ||
    fail "the RBD image differs from the device served through the cache"
log "the RBD image, read through the store alone, equals the device byte for byte"
loop_attach "$TEST_DIR/store.copy"
check_fsck "$LOOP_DEV"
do_mount "$LOOP_DEV" "$MNT"
verify_sums "$TEST_DIR/sums"
do_umount "$MNT"
loop_detach "$LOOP_DEV"
"$CEPH/stop.sh" "$CLUSTER" 2>>"$TEST_DIR/ceph-stop.log" || fail "stopping the cluster failed"
log "PASS"
