#!/usr/bin/env bash
# Byte-granular requests (issue 13): the export advertises a minimum block size of 1.
# 1. qemu-io writes at 512-byte offsets and lengths (and a few odd byte ranges), in write-back
#    and write-through, to the export and to a reference file; the whole device, read back
#    through NBD, equals the reference, also after a kill -9 and restart (write-back: flushed
#    first) and, after `ssdcache flush`, on the backing file itself.
# 2. ext4 with 1 KiB blocks (mkfs.ext4 -b 1024) on the device through nbdfuse + a loop device
#    with direct I/O: requests that are not whole 4 KiB sectors reach the server (its trace
#    records them), a tree of files survives a restart, fsck is clean.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io qemu-img nbdfuse fusermount3 losetup mkfs.ext4 fsck.ext4 mount umount sha256sum mountpoint jq cmp awk
require_bin
K=1024; M=$((1024 * 1024))
SIZE=$((64 * M))

# ops_for SEED: qemu-io write commands at 512-byte offsets and lengths, a few at odd bytes,
# clustered so that they overlap each other and share sectors and lines.
ops_for() {
    local i off len pat
    RANDOM=$1
    for ((i = 0; i < 160; i++)); do
        pat=$(( (i * 7 + $1) % 255 + 1 ))
        if ((i % 9 == 0)); then
            off=$(( (RANDOM * 32768 + RANDOM) % (SIZE - 70000) ))   # any byte
            len=$(( 1 + RANDOM % 9000 ))
        else
            off=$(( (RANDOM % (i % 3 == 0 ? 131072 : 4096)) * 512 ))
            len=$(( (1 + RANDOM % (i % 4 == 0 ? 200 : 9)) * 512 ))
        fi
        ((off + len <= SIZE)) || continue
        printf 'write -P %d %d %d\n' "$pat" "$off" "$len"
        if ((i % 13 == 0)); then printf 'write -z %d %d\n' $((off + 512)) 1536; fi
    done
}

# apply URI_OR_FILE FORMAT_ARGS... < commands: every command in one qemu-io run.
apply_ops() {
    local target=$1 args=() c
    while IFS= read -r c; do args+=("$c"); done
    qio "$target" "${args[@]}" "flush" >/dev/null
}

# same_as_reference URI REF WHAT: the whole export, read through NBD, equals REF.
same_as_reference() {
    rm -f "$TEST_DIR/readback.img"
    timeout -k 5 120 qemu-img convert -f raw -O raw "$1" "$TEST_DIR/readback.img" \
        || fail "qemu-img convert of $1 failed"
    cmp "$TEST_DIR/readback.img" "$2" || fail "$3: the device differs from the reference image"
    log "$3: the device equals the reference image"
}

for mode in write-back write-through; do
    log "---- $mode: 512-byte requests against a reference image ----"
    mk_sparse "backing-$mode.img" "$SIZE"
    mk_sparse "cache-$mode.img" 32M
    mk_sparse "ref-$mode.img" "$SIZE"
    create_cache "cache-$mode.img" "backing-$mode.img" --name v --mode "$mode" --line-size 64KiB
    start_server "$TEST_DIR/nbd.sock" --cache "cache-$mode.img"
    URI=$(nbd_uri "$SOCK")
    info=$(timeout -k 5 30 nbdinfo --json "$URI") || fail "nbdinfo failed"
    assert_eq "$(jq -r '.exports[0].block_size_minimum' <<<"$info")" 1 "advertised minimum block size"
    for seed in 1 2; do
        ops_for "$seed" >"$TEST_DIR/ops.$seed"
        apply_ops "$URI" <"$TEST_DIR/ops.$seed"
        apply_ops "ref-$mode.img" <"$TEST_DIR/ops.$seed"
    done
    # Reads at odd offsets and lengths, checked against the reference's bytes.
    qio "$URI" "read -v 1000 3" >"$TEST_DIR/odd.nbd"
    qio "ref-$mode.img" "read -v 1000 3" >"$TEST_DIR/odd.ref"
    assert_eq "$(head -n 1 "$TEST_DIR/odd.nbd")" "$(head -n 1 "$TEST_DIR/odd.ref")" "3 bytes at 1000"
    same_as_reference "$URI" "ref-$mode.img" "$mode, serving"
    st=$(stats_json "cache-$mode.img")
    if [[ $mode == write-back ]]; then
        assert_gt "$(vol_field "$st" v dirty_bytes)" 0 "dirty bytes after the writes in write-back"
    fi
    kill9_server
    KEEP_STALE_SOCKET=1 start_server "$TEST_DIR/nbd.sock" --cache "cache-$mode.img"
    same_as_reference "$URI" "ref-$mode.img" "$mode, after kill -9 and restart"
    stop_server
    if [[ $mode == write-back ]]; then
        out=$(timeout -k 5 120 "$SSDCACHE_BIN" flush --cache "cache-$mode.img" 2>&1) || fail "ssdcache flush failed: $out"
    fi
    cmp "backing-$mode.img" "ref-$mode.img" || fail "$mode: the backing file differs from the reference"
    log "$mode: the backing file equals the reference image"
done

log "---- ext4 with 1 KiB blocks ----"
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-back
FUSEDIR="$TEST_DIR/fuse"
MNT="$TEST_DIR/mnt"
attach() {
    nbdfuse_attach "$FUSEDIR" "$(nbd_uri "$SOCK")"
    # Direct I/O on a 512-byte-sector loop device: the filesystem's 1 KiB blocks reach
    # nbdfuse, and through it the server, as they are.
    LOOP_DEV=$(losetup --find --show --direct-io=on --sector-size 512 "$FUSE_FILE") \
        || fail "losetup --direct-io=on --sector-size 512 $FUSE_FILE failed"
    _LOOPS+=("$LOOP_DEV")
}
detach() {
    loop_detach "$LOOP_DEV"
    nbdfuse_detach "$FUSEDIR"
}
start_server "$TEST_DIR/nbd.sock" --cache cache.img --record-trace "$TEST_DIR/fs.trace"
attach
mkfs.ext4 -q -F -b 1024 "$LOOP_DEV" || fail "mkfs.ext4 -b 1024 on $LOOP_DEV failed"
do_mount "$LOOP_DEV" "$MNT"
make_tree "$MNT/tree" 3
checksum_tree tree "$TEST_DIR/tree.sha256"
sync -f "$MNT" 2>/dev/null || sync
do_umount "$MNT"
check_fsck "$LOOP_DEV"
detach
stop_server
partial=$(awk -F, '!/^#/ && ($4 % 4096 != 0 || $5 % 4096 != 0) { n++ } END { print n + 0 }' "$TEST_DIR/fs.trace")
log "requests not of whole 4 KiB sectors in the filesystem's trace: $partial"
assert_gt "$partial" 0 "requests not of whole 4 KiB sectors from ext4 with 1 KiB blocks"
start_server "$TEST_DIR/nbd.sock" --cache cache.img
attach
do_mount "$LOOP_DEV" "$MNT"
verify_sums "$TEST_DIR/tree.sha256"
do_umount "$MNT"
check_fsck "$LOOP_DEV"
detach
stop_server
log "ok"
