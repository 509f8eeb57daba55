#!/usr/bin/env bash
# ext4 on the export (nbdfuse -> loop device): a tree of files survives a graceful restart and,
# in write-through mode, a kill -9 (the cache restarts cold, never stale); fsck is clean each time.
source "$(dirname "$0")/lib.sh"
require_tool nbdfuse fusermount3 losetup mkfs.ext4 fsck.ext4 mount umount sha256sum mountpoint jq
require_bin
[[ -e /dev/fuse ]] || fail "/dev/fuse missing"

mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name vol0 --mode write-through

FUSEDIR="$TEST_DIR/fuse"
MNT="$TEST_DIR/mnt"

setup_fs() { # attach nbdfuse + loop, mount
    nbdfuse_attach "$FUSEDIR" "$(nbd_uri "$SOCK")"
    assert_eq "$(stat -c %s "$FUSE_FILE")" $((512 << 20)) "size of the nbdfuse file"
    loop_attach "$FUSE_FILE"
    if [[ "${1:-}" == mkfs ]]; then
        mkfs.ext4 -q -F "$LOOP_DEV" || fail "mkfs.ext4 on $LOOP_DEV failed"
    fi
    do_mount "$LOOP_DEV" "$MNT"
}
teardown_fs() { # sync, umount, losetup -d, fusermount -u
    sync -f "$MNT" 2>/dev/null || sync
    do_umount "$MNT"
    loop_detach "$LOOP_DEV"
    nbdfuse_detach "$FUSEDIR"
}
# ---- 1. graceful restart ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img
setup_fs mkfs
make_tree "$MNT/tree1" 1
checksum_tree tree1 "$TEST_DIR/tree1.sha256"
log "wrote $(du -sm "$MNT/tree1" | cut -f1) MiB in tree1"
teardown_fs
stop_server

start_server "$TEST_DIR/nbd.sock" --cache cache.img
setup_fs
verify_sums "$TEST_DIR/tree1.sha256"
do_umount "$MNT"
check_fsck "$LOOP_DEV"
do_mount "$LOOP_DEV" "$MNT"

# ---- 2. kill -9 (write-through: every acknowledged write is on the backing) ----
make_tree "$MNT/tree2" 2
checksum_tree tree2 "$TEST_DIR/tree2.sha256"
rm -rf "$MNT/tree1/d3"   # deletes + discards too
(cd "$MNT" && find tree1 -type f -print0 | sort -z | xargs -0 sha256sum) >"$TEST_DIR/tree1b.sha256"
teardown_fs
st=$(stats_json cache.img)
log "stats before kill -9: $(jq -c . <<<"$st")"
assert_gt "$(vol_field "$st" vol0 occupancy_bytes)" 0 "occupancy before kill -9"
kill9_server

start_server "$TEST_DIR/nbd.sock" --cache cache.img
st=$(stats_json cache.img)
log "stats right after restart from kill -9: $(jq -c . <<<"$st")"
assert_eq "$(vol_field "$st" vol0 occupancy_bytes)" 0 "occupancy right after an unclean restart (cache must start cold)"
setup_fs
verify_sums "$TEST_DIR/tree1b.sha256"
verify_sums "$TEST_DIR/tree2.sha256"
[[ ! -e "$MNT/tree1/d3" ]] || fail "deleted directory came back after kill -9 restart (stale cache)"
do_umount "$MNT"
check_fsck "$LOOP_DEV"
loop_detach "$LOOP_DEV"
nbdfuse_detach "$FUSEDIR"
st=$(stats_json cache.img)
log "stats after re-reading: $(jq -c . <<<"$st")"
stop_server
log "ok"
