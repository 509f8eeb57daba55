#!/usr/bin/env bash
# Structured replies and block status (issue 13 item 3): nbdinfo --map and qemu-img map over
# ssdcache show the backing file's holes; data written back-cached into a hole (dirty in the
# cache, still a hole in the file) shows as data; reads through structured replies are exact;
# a sparse qemu-img convert and an nbdcopy through ssdcache allocate no more than the source.
source "$(dirname "$0")/lib.sh"
require_tool nbdinfo nbdkit qemu-img qemu-io nbdcopy jq truncate dd cmp du
require_bin

# A 64 MiB sparse backing file with data at 4 MiB (128 KiB) and 40 MiB (64 KiB).
mk_sparse backing.img 64M
dd if=/dev/urandom of=backing.img bs=64k count=2 seek=64 conv=notrunc status=none
dd if=/dev/urandom of=backing.img bs=64k count=1 seek=640 conv=notrunc status=none
cp --sparse=always backing.img reference.img
mk_sparse cache.img 64M
create_cache cache.img backing.img --mode write-back
start_server "$TEST_DIR/nbd.sock" --cache cache.img
URI=$(nbd_uri "$SOCK")

# map_type URI OFFSET: the base:allocation type (0 data, 3 hole,zero) nbdinfo reports there.
map_type() {
    local map
    map=$(timeout 60 nbdinfo --map --json "$1") || fail "nbdinfo --map failed on $1"
    jq -r --argjson at "$2" \
        '[.[] | select(.offset <= $at and $at < .offset + .length)][0].type // "none"' <<<"$map"
}

[[ $(timeout 30 nbdinfo --can structured-reply "$URI"; echo $?) == 0 ]] ||
    fail "the server does not offer structured replies"
log "nbdinfo --map: $(timeout 60 nbdinfo --map "$URI" | tr -s ' ' | tr '\n' ';')"
assert_eq "$(map_type "$URI" 0)" 3 "type at 0 (a hole in the backing file)"
assert_eq "$(map_type "$URI" $((4 << 20)))" 0 "type at 4 MiB (data)"
assert_eq "$(map_type "$URI" $((4 << 20 | 128 << 10)))" 3 "type just after the data at 4 MiB"
assert_eq "$(map_type "$URI" $((40 << 20)))" 0 "type at 40 MiB (data)"
assert_eq "$(map_type "$URI" $((63 << 20)))" 3 "type at 63 MiB (a hole)"

# qemu-img map sees the same.
qmap=$(timeout 60 qemu-img map --output=json -f raw "$URI") || fail "qemu-img map failed"
data_at() { # data_at OFFSET: qemu-img map's "data" there
    jq -r --argjson at "$1" \
        '[.[] | select(.start <= $at and $at < .start + .length)][0].data' <<<"$qmap"
}
assert_eq "$(data_at 0)" false "qemu-img map: data at 0"
assert_eq "$(data_at $((4 << 20)))" true "qemu-img map: data at 4 MiB"
assert_eq "$(data_at $((20 << 20)))" false "qemu-img map: data at 20 MiB"

# Write-back data into a hole: dirty in the cache, still a hole in the file, data in the map.
qio "$URI" "write -P 0x5a $((20 << 20)) 64k" "write -P 0x33 $((30 << 20 | 512)) 512" >/dev/null
head -c 65536 /dev/zero | tr '\0' '\132' |
    dd of=reference.img bs=64k seek=320 conv=notrunc status=none
head -c 512 /dev/zero | tr '\0' '\063' |
    dd of=reference.img bs=512 seek=$((30 << 11 | 1)) conv=notrunc status=none
assert_eq "$(map_type "$URI" $((20 << 20)))" 0 "type at 20 MiB after a write-back write (dirty)"
assert_eq "$(map_type "$URI" $((30 << 20 | 512)))" 0 "type of a 512-byte write-back write"
file_map=$(timeout 60 nbdinfo --map --json -- [ nbdkit file "$TEST_DIR/backing.img" ]) ||
    fail "nbdinfo --map of the backing file through nbdkit failed"
assert_eq "$(jq -r --argjson at $((20 << 20)) \
    '[.[] | select(.offset <= $at and $at < .offset + .length)][0].type' <<<"$file_map")" 3 \
    "the backing file is still a hole at 20 MiB (the data is only in the cache)"

# Reads through structured replies are exact: the whole device equals the reference.
timeout -k 5 180 nbdcopy "$URI" copy-before.raw || fail "nbdcopy from ssdcache failed"
cmp copy-before.raw reference.img || fail "nbdcopy of the device differs from the reference"
qio "$URI" "read -P 0x5a $((20 << 20)) 64k" "read -P 0 0 4M" "read -P 0 $((60 << 20)) 1M" >/dev/null

# After a flush the data is in the backing file; the map is unchanged.
out=$(timeout -k 5 120 "$SSDCACHE_BIN" flush --cache cache.img 2>&1) || fail "ssdcache flush failed: $out"
assert_eq "$(map_type "$URI" $((20 << 20)))" 0 "type at 20 MiB after the flush"
assert_eq "$(map_type "$URI" $((10 << 20)))" 3 "type at 10 MiB after the flush"

# A sparse convert and an nbdcopy through ssdcache allocate no more than the same tool
# copying the backing file itself (qemu-img's raw driver allocates the first 4 KiB of every
# image it creates, holes or not, so the source's own allocation is not the bound for it).
source_alloc=$(du -B1 backing.img | cut -f1)
timeout -k 5 180 qemu-img convert -f raw -O raw backing.img direct-convert.raw ||
    fail "qemu-img convert of the backing file failed"
timeout -k 5 180 nbdcopy -- [ nbdkit file "$TEST_DIR/backing.img" ] direct-copy.raw ||
    fail "nbdcopy of the backing file failed"
timeout -k 5 180 qemu-img convert -f raw -O raw "$URI" converted.raw || fail "qemu-img convert failed"
timeout -k 5 180 nbdcopy "$URI" copied.raw || fail "nbdcopy failed"
for pair in converted.raw:direct-convert.raw copied.raw:direct-copy.raw; do
    out=${pair%%:*} direct=${pair##*:}
    cmp "$out" reference.img || fail "$out differs from the reference"
    alloc=$(du -B1 "$out" | cut -f1) bound=$(du -B1 "$direct" | cut -f1)
    log "$out: $alloc bytes allocated; the same copy of the backing file: $bound; the file: $source_alloc"
    (( alloc <= bound )) ||
        fail "$out allocates $alloc bytes, more than $bound from the backing file (holes not seen)"
done
(( source_alloc < 8 << 20 )) || fail "the backing file is not sparse ($source_alloc bytes)"
assert_server_alive
stop_server
