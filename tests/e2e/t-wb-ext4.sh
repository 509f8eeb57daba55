#!/usr/bin/env bash
# ext4 on a write-back export (nbdfuse -> loop device).
#  1. A synced tree of files survives a kill -9 of the daemon with the filesystem still mounted
#     and a writer busy on it (some files fsync'ed one by one, some never synced): after the
#     restart the journal replays, fsck is clean, every synced and every fsync'ed file matches.
#  2. More files, sync, `ssdcache flush` (dirty_bytes drops to 0), a clean stop and
#     `ssdcache detach`: then the backing file alone, loop-mounted without ssdcache, holds a clean
#     filesystem with every file of both phases.
# WB_MODE overrides the mode (e.g. WB_MODE=write-through to exercise the harness itself; the
# dirty_bytes assertions then need that field too).
source "$(dirname "$0")/lib.sh"
require_tool nbdfuse fusermount3 losetup mkfs.ext4 fsck.ext4 mount umount sha256sum mountpoint jq \
    timeout dd sync findmnt
require_bin
[[ -e /dev/fuse ]] || fail "/dev/fuse missing"
MODE=${WB_MODE:-write-back}

mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name vol0 --mode "$MODE"

MNT="$TEST_DIR/mnt"
FUSE_N=0

setup_fs() { # attach nbdfuse (a fresh directory each time) + loop, mkfs with "mkfs", mount
    FUSE_N=$((FUSE_N + 1))
    FUSEDIR="$TEST_DIR/fuse$FUSE_N"
    nbdfuse_attach "$FUSEDIR" "$(nbd_uri "$SOCK")"
    assert_eq "$(stat -c %s "$FUSE_FILE")" $((512 << 20)) "size of the nbdfuse file"
    loop_attach "$FUSE_FILE"
    if [[ "${1:-}" == mkfs ]]; then
        mkfs.ext4 -q -F "$LOOP_DEV" || fail "mkfs.ext4 on $LOOP_DEV failed"
    fi
    do_mount "$LOOP_DEV" "$MNT"
}
teardown_fs() { # graceful: sync, umount, losetup -d, fusermount -u
    sync -f "$MNT" || fail "sync -f $MNT failed"
    do_umount "$MNT"
    loop_detach "$LOOP_DEV"
    nbdfuse_detach "$FUSEDIR"
}
# is_mounted DIR: from the mount table, not stat(): `mountpoint` fails on a dead FUSE mount
# ("Transport endpoint is not connected"), which is exactly what nbdfuse leaves after a kill -9.
is_mounted() { findmnt -rn -M "$1" >/dev/null 2>&1; }
# crash_teardown: the daemon is dead, so the mount -> loop -> nbdfuse stack can no longer do I/O
# (nbdfuse exits when its NBD connection dies; every request fails). Undo it lazily, bounded,
# without waiting for I/O that cannot complete.
crash_teardown() {
    local old_loop=$LOOP_DEV old_file=$FUSE_FILE i
    if is_mounted "$MNT"; then
        timeout -k 5 30 umount -l "$MNT" || fail "umount -l $MNT failed after the kill -9"
    fi
    if [[ "$(losetup -nO BACK-FILE "$old_loop" 2>/dev/null)" == "$old_file"* ]]; then
        timeout -k 5 30 losetup -d "$old_loop" || log "warning: losetup -d $old_loop failed (autoclear pending)"
    fi
    if is_mounted "$FUSEDIR"; then
        timeout -k 5 30 fusermount3 -uz "$FUSEDIR" || fail "fusermount3 -uz $FUSEDIR failed"
    fi
    ! is_mounted "$FUSEDIR" || fail "$FUSEDIR still mounted after fusermount3 -uz"
    if ! _wait_gone "$FUSE_PID" 30; then
        log "nbdfuse $FUSE_PID still running 30s after the lazy unmount; killing it"
        kill -KILL "$FUSE_PID" 2>/dev/null || true
        _wait_gone "$FUSE_PID" 10 || fail "nbdfuse $FUSE_PID survived SIGKILL"
    fi
    wait "$FUSE_PID" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        [[ "$(losetup -nO BACK-FILE "$old_loop" 2>/dev/null)" == "$old_file"* ]] || break
        sleep 0.1
    done
    [[ "$(losetup -nO BACK-FILE "$old_loop" 2>/dev/null)" != "$old_file"* ]] ||
        log "warning: $old_loop still bound to the dead nbdfuse file after 10s (autoclear pending)"
    log "dead stack torn down (lazy umount, losetup -d, fusermount3 -uz)"
}
# dirty_info: the live dirty_bytes of vol0, for the log only ("n/a" if the field is missing).
dirty_info() { jq -r '.volumes[] | select(.name == "vol0") | .dirty_bytes // "n/a"' <<<"$(stats_json cache.img)"; }

# crash_writer LIST: until killed (at most 2000 files / 60 s), writes files into $MNT/crash;
# every odd one is fsync'ed (file, then directory) and, once that returned, its checksum is
# appended to LIST (outside the mount). Errors end it quietly: they are expected after the kill.
crash_writer() {
    local list=$1 i end=$((SECONDS + 60)) src="$TEST_DIR/crash.src" sum
    trap - ERR EXIT
    set +eE
    mkdir -p "$MNT/crash" || return 0
    for ((i = 0; i < 2000 && SECONDS < end; i++)); do
        head -c $((4096 + RANDOM * 4)) /dev/urandom >"$src"
        if ((i % 2)); then
            timeout 30 dd if="$src" of="$MNT/crash/f$i" bs=64k conv=fsync status=none 2>/dev/null || return 0
            timeout 30 sync "$MNT/crash" 2>/dev/null || return 0
            sum=$(sha256sum <"$src" | cut -d' ' -f1)
            printf '%s  crash/f%d\n' "$sum" "$i" >>"$list"
        else
            timeout 30 cp "$src" "$MNT/crash/f$i" 2>/dev/null || return 0
        fi
    done
}

# ---- 1. kill -9 under a mounted filesystem ----
start_server "$TEST_DIR/nbd.sock" --cache cache.img
setup_fs mkfs
make_tree "$MNT/tree1" 1
sync -f "$MNT" || fail "sync -f $MNT failed"
checksum_tree tree1 "$TEST_DIR/tree1.sha256"
log "wrote and synced $(du -sm "$MNT/tree1" | cut -f1) MiB in tree1; dirty_bytes=$(dirty_info)"

LIST="$TEST_DIR/fsynced.sha256"
: >"$LIST"
crash_writer "$LIST" >/dev/null 2>&1 &
CW_PID=$!
_PIDS+=("$CW_PID")
for ((i = 0; i < 300; i++)); do
    (($(wc -l <"$LIST") >= 20)) && break
    _is_ours_alive "$CW_PID" || fail "the crash writer ended early ($(wc -l <"$LIST") files fsync'ed)"
    sleep 0.1
done
(($(wc -l <"$LIST") >= 20)) || fail "the crash writer fsync'ed only $(wc -l <"$LIST") files in 30s"
st=$(stats_json cache.img)
log "stats right before kill -9: $(jq -c . <<<"$st")"
kill9_server
NFS=$(wc -l <"$LIST")
log "kill -9 with the filesystem mounted and a writer busy: $NFS files fsync'ed before it"
# The writer's next fsync fails (EIO) and it ends; then the dead stack can be taken apart.
_wait_gone "$CW_PID" 60 || fail "the crash writer did not end within 60s of the kill -9"
wait "$CW_PID" 2>/dev/null || true
NFS=$(wc -l <"$LIST")
crash_teardown

KEEP_STALE_SOCKET=1 start_server "$TEST_DIR/nbd.sock" --cache cache.img
st=$(stats_json cache.img)
log "stats right after the restart from kill -9: $(jq -c . <<<"$st")"
# Mount first: the journal replays (a crash leaves it needing recovery); fsck after the umount.
setup_fs
verify_sums "$TEST_DIR/tree1.sha256"
verify_sums "$LIST"
[[ -L "$MNT/tree1/link" && -e "$MNT/tree1/link" ]] || fail "symlink tree1/link lost after kill -9"
assert_eq "$(stat -c %h "$MNT/tree1/page")" 2 "link count of tree1/page after kill -9"
do_umount "$MNT"
check_fsck "$LOOP_DEV"
do_mount "$LOOP_DEV" "$MNT"

# ---- 2. more files, flush, clean stop, detach, the backing file alone ----
make_tree "$MNT/tree2" 2
rm -rf "$MNT/tree1/d3"   # deletes + discards of data that may still be dirty in the cache
rm -rf "$MNT/crash"      # (its fsync'ed files were checked above)
sync -f "$MNT" || fail "sync -f $MNT failed"
checksum_tree tree2 "$TEST_DIR/tree2.sha256"
checksum_tree tree1 "$TEST_DIR/tree1b.sha256" 150
log "tree2 written and synced; dirty_bytes=$(dirty_info)"

# flush while the filesystem is mounted (a live client)
rc=0
timeout -k 5 300 "$SSDCACHE_BIN" flush --cache cache.img >"$TEST_DIR/flush1.out" 2>"$TEST_DIR/flush1.err" || rc=$?
[[ $rc -eq 0 ]] || fail "ssdcache flush (filesystem mounted) exited $rc:
$(tail -n 20 "$TEST_DIR/flush1.err")"
log "flush with the filesystem mounted: $(tail -n 1 "$TEST_DIR/flush1.err"); dirty_bytes=$(dirty_info)"

teardown_fs
# nothing writes any more: after this flush no dirty data may remain
rc=0
timeout -k 5 300 "$SSDCACHE_BIN" flush --cache cache.img >"$TEST_DIR/flush2.out" 2>"$TEST_DIR/flush2.err" || rc=$?
[[ $rc -eq 0 ]] || fail "ssdcache flush exited $rc:
$(tail -n 20 "$TEST_DIR/flush2.err")"
[[ -s "$TEST_DIR/flush2.err" ]] || log "note: flush printed no progress on stderr"
st=$(stats_json cache.img)
log "stats after flush: $(jq -c . <<<"$st")"
assert_eq "$(vol_field "$st" vol0 dirty_bytes)" 0 "dirty_bytes after ssdcache flush"
stop_server

out=$(timeout -k 5 300 "$SSDCACHE_BIN" detach --cache cache.img 2>&1) || fail "ssdcache detach --cache cache.img failed: $out"
log "detach: $(tr '\n' ' ' <<<"$out" | head -c 300)"

# The backing file alone, no ssdcache at all.
loop_attach backing.img
check_fsck "$LOOP_DEV"
do_mount "$LOOP_DEV" "$MNT"
verify_sums "$TEST_DIR/tree1b.sha256"
verify_sums "$TEST_DIR/tree2.sha256"
[[ ! -e "$MNT/tree1/d3" ]] || fail "deleted directory tree1/d3 is back in the backing file"
[[ ! -e "$MNT/crash" ]] || fail "deleted directory crash is back in the backing file"
[[ -L "$MNT/tree1/link" && -e "$MNT/tree1/link" ]] || fail "symlink tree1/link missing in the backing file"
do_umount "$MNT"
loop_detach "$LOOP_DEV"
log "ok: the backing file alone holds a clean filesystem with all $(( $(wc -l <"$TEST_DIR/tree1b.sha256") + $(wc -l <"$TEST_DIR/tree2.sha256") )) files; $NFS files fsync'ed before the kill -9 survived it"
