#!/usr/bin/env bash
# qemu-img convert/compare and nbdcopy round trips of a 256 MiB random image through a 128 MiB
# cache (so lines get evicted and the comparison reads a mix of cached and backing data).
source "$(dirname "$0")/lib.sh"
require_tool qemu-img nbdcopy cmp truncate head
require_bin

M=$((1024 * 1024))
mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name vol0 --mode write-through

head -c $((256 * M)) /dev/urandom >image.raw
start_server "$TEST_DIR/nbd.sock" --cache cache.img
URI=$(nbd_uri "$SOCK")

log "qemu-img convert -n image -> export"
timeout -k 5 180 qemu-img convert -n -f raw -O raw image.raw "$URI"
log "qemu-img compare image <-> export"
rc=0; out=$(timeout -k 5 180 qemu-img compare -f raw -F raw image.raw "$URI" 2>&1) || rc=$?
[[ $rc -eq 0 ]] || fail "qemu-img compare: status $rc: $out"
assert_contains "$out" "Images are identical" "qemu-img compare"
# Strict size check must notice the size difference (export is 512 MiB) -- proves it read the export.
rc=0; out=$(timeout -k 5 180 qemu-img compare -s -f raw -F raw image.raw "$URI" 2>&1) || rc=$?
[[ $rc -eq 1 ]] || fail "qemu-img compare -s should report a size mismatch (1), got $rc: $out"

# A second, different image via nbdcopy (multi-conn), then copy the whole export back out.
head -c $((256 * M)) /dev/urandom >image2.raw
cmp -s image.raw image2.raw && fail "two random images are identical?"
log "nbdcopy image2 -> export"
timeout -k 5 180 nbdcopy --flush image2.raw "$URI"
log "nbdcopy export -> out.raw"
timeout -k 5 180 nbdcopy "$URI" out.raw
assert_eq "$(stat -c %s out.raw)" $((512 * M)) "size of the copied-out export"
cmp -n $((256 * M)) image2.raw out.raw || fail "nbdcopy round trip: data differs"
cmp -n $((256 * M)) -i $((256 * M)):0 out.raw /dev/zero || fail "never-written upper half is not zeros"
log "nbdcopy round trip identical"

# qemu-img sees the new data too (through the cache, after nbdcopy's writes).
rc=0; out=$(timeout -k 5 180 qemu-img compare -f raw -F raw image2.raw "$URI" 2>&1) || rc=$?
[[ $rc -eq 0 ]] || fail "qemu-img compare after nbdcopy: status $rc: $out"
assert_server_alive
stop_server

# After a graceful restart the data is still identical.
start_server "$TEST_DIR/nbd.sock" --cache cache.img
rm -f out.raw
timeout -k 5 180 nbdcopy "$URI" out.raw
cmp -n $((256 * M)) image2.raw out.raw || fail "data differs after restart"
stop_server
log "ok"
