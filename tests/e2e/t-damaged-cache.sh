#!/usr/bin/env bash
# Damaged caches. `create` never overwrites a cache that holds dirty data, or may, unless
# --discard-dirty-data says so (--force alone is not enough): a truncated cache (the amount is
# read from its checkpoint), one stopped uncleanly whose journal is cut off (the amount cannot
# be known), one whose two superblock copies are damaged. A device that is not a cache needs
# no flag.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq cmp truncate dd sha256sum
require_bin
M=$((1024 * 1024))

mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name wb --mode write-back --sequential-cutoff 0
URI=$(nbd_uri "$TEST_DIR/wb.sock" wb)

# 8 MiB dirty, kept across a clean stop (the checkpoint records it).
start_server "$TEST_DIR/wb.sock" --cache cache.img --writeback-max-age 3600
qio "$URI" "write -P 0x11 0 8M" "flush" >/dev/null
stop_server
assert_eq "$(ssd info --cache cache.img --json | jq '.volumes[0].dirty_bytes')" $((8 * M)) "dirty bytes after a clean stop"

# copy_of SRC DST: a sparse copy of a cache file.
copy_of() { cp --sparse=always "$1" "$2"; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

# ---- truncated, metadata still readable: the refusal names the volume and the bytes ----
copy_of cache.img truncated.img
truncate -s 32M truncated.img
before=$(sha truncated.img)
expect_status 1 "create --force on a truncated cache holding dirty data" \
    "truncated.*holds 8 MiB of dirty data.*volume 'wb'.*8 MiB in 128 lines.*--force never discards.*--discard-dirty-data" \
    "$SSDCACHE_BIN" create --cache truncated.img --backing backing.img --force
expect_status 1 "plain create on a truncated cache holding dirty data" \
    "truncated.*8 MiB of dirty data.*flush.*--discard-dirty-data" \
    "$SSDCACHE_BIN" create --cache truncated.img --backing backing.img
assert_eq "$(sha truncated.img)" "$before" "truncated cache after refused creates"
old_uuid=$(jq -r .uuid <<<"$(ssd info --cache cache.img --json)")
out=$(ssd create --cache truncated.img --backing backing.img --name fresh --discard-dirty-data 2>&1) ||
    fail "create --discard-dirty-data on the truncated cache failed: $out"
assert_contains "$out" "discarding 8 MiB of dirty data" "create --discard-dirty-data says what it discards"
info=$(ssd info --cache truncated.img --json)
assert_eq "$(jq -r '.volumes[0].name' <<<"$info")" fresh "the re-created cache's volume"
[[ "$(jq -r .uuid <<<"$info")" != "$old_uuid" ]] || fail "the re-created cache kept the old uuid"
log "truncated cache: refused with the amount; --discard-dirty-data re-creates it"

# ---- stopped uncleanly, journal cut off: the amount cannot be known ----
copy_of cache.img unclean.img
start_server "$TEST_DIR/unclean.sock" --cache unclean.img --writeback-max-age 3600
qio "$(nbd_uri "$SOCK" wb)" "write -P 0x22 16M 4M" "flush" >/dev/null
kill9_server
journal_at=$(ssd info --cache unclean.img --json | jq .journal_offset)
truncate -s "$journal_at" unclean.img # the superblocks and the checkpoint area stay
before=$(sha unclean.img)
expect_status 1 "create --force on an unclean cache whose journal is gone" \
    "stopped uncleanly.*cannot be known.*volume 'wb'.*--force never discards.*--discard-dirty-data" \
    "$SSDCACHE_BIN" create --cache unclean.img --backing backing.img --force
assert_eq "$(sha unclean.img)" "$before" "unclean cache after a refused create"

# ---- both superblock copies damaged: refused even without --force ----
for damage in random magic; do
    copy_of cache.img both.img
    if [[ $damage == random ]]; then
        dd if=/dev/urandom of=both.img bs=64k count=2 conv=notrunc status=none
    else # the magic stays, a header byte changes in each copy: checksums fail
        printf 'XXXX' | dd of=both.img bs=1 seek=100 conv=notrunc status=none
        printf 'XXXX' | dd of=both.img bs=1 seek=$((65536 + 100)) conv=notrunc status=none
    fi
    before=$(sha both.img)
    expect_status 1 "plain create over both superblock copies damaged ($damage)" \
        "looks like an ssdcache cache.*both damaged.*cannot be known.*--discard-dirty-data" \
        "$SSDCACHE_BIN" create --cache both.img --backing backing.img
    expect_status 1 "create --force over both superblock copies damaged ($damage)" \
        "both damaged.*--force never discards dirty data" \
        "$SSDCACHE_BIN" create --cache both.img --backing backing.img --force
    expect_status 1 "info on a cache with both superblock copies damaged ($damage)" \
        "superblock copies are both damaged" \
        "$SSDCACHE_BIN" info --cache both.img
    assert_eq "$(sha both.img)" "$before" "cache with both copies damaged after refused creates"
    out=$(ssd create --cache both.img --backing backing.img --discard-dirty-data 2>&1) ||
        fail "create --discard-dirty-data over damaged superblocks failed: $out"
    ssd info --cache both.img >/dev/null || fail "the re-created cache does not read back"
done
log "both copies damaged: refused without --discard-dirty-data"

# ---- a device that is not a cache: create needs no flag, as before ----
mk_sparse zeros.img 64M
create_cache zeros.img backing.img --name z

log "ok"
