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
check_fsck() {
    local out rc=0
    out=$(fsck.ext4 -fn "$LOOP_DEV" 2>&1) || rc=$?
    [[ $rc -eq 0 ]] || fail "fsck.ext4 -fn $LOOP_DEV: status $rc:
$out"
    log "fsck clean"
}

# make_tree DIR SEED: ~250 files in nested directories, sizes 0..64 KiB with every 25th 1..3 MiB.
make_tree() {
    local root=$1 seed=$2 i d size
    RANDOM=$seed
    for ((i = 0; i < 250; i++)); do
        d="$root/d$((i % 7))/s$((i % 5))/t$((i % 3))"
        mkdir -p "$d"
        if ((i % 25 == 0)); then
            size=$(( (1 + RANDOM % 3) * 1024 * 1024 + RANDOM ))
        else
            size=$(( (RANDOM * 2) % 65537 ))
        fi
        head -c "$size" /dev/urandom >"$d/f$i.bin"
    done
    # A few special cases: empty file, exact 4 KiB, a symlink, a hard link.
    : >"$root/empty"
    head -c 4096 /dev/urandom >"$root/page"
    ln -s d0/s0/t0/f0.bin "$root/link"
    ln "$root/page" "$root/page.hard"
}

checksum_tree() { # checksum_tree SUBDIR OUTFILE (paths relative to the mount)
    (cd "$MNT" && find "$1" -type f -print0 | sort -z | xargs -0 sha256sum) >"$2"
    local n
    n=$(wc -l <"$2")
    assert_gt "$n" 200 "files checksummed in $1"
}
verify_tree() { # verify_tree SUMFILE
    local out rc=0
    out=$(cd "$MNT" && sha256sum --quiet -c "$1" 2>&1) || rc=$?
    [[ $rc -eq 0 ]] || fail "sha256sum -c $1 failed (status $rc):
$(head -n 40 <<<"$out")"
    log "all $(wc -l <"$1") checksums in $(basename "$1") match"
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
verify_tree "$TEST_DIR/tree1.sha256"
do_umount "$MNT"
check_fsck
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
verify_tree "$TEST_DIR/tree1b.sha256"
verify_tree "$TEST_DIR/tree2.sha256"
[[ ! -e "$MNT/tree1/d3" ]] || fail "deleted directory came back after kill -9 restart (stale cache)"
do_umount "$MNT"
check_fsck
loop_detach "$LOOP_DEV"
nbdfuse_detach "$FUSEDIR"
st=$(stats_json cache.img)
log "stats after re-reading: $(jq -c . <<<"$st")"
stop_server
log "ok"
