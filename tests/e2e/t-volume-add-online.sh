#!/usr/bin/env bash
# `ssdcache volume add` while a daemon serves the cache: the daemon opens and locks the new
# backing device, records the volume and exports it at once, while a client keeps writing to
# another export over one connection (every write lands, the connection is not interrupted);
# the new export is listed and serves its own data; per-volume stats add up to the cache's;
# kill -9 and a restart keep both volumes' dirty data; refusals (a taken name, another
# volume's device, the cache itself, a missing file, a copy of the served cache image) change
# nothing.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io qemu-img nbdinfo jq truncate cmp
require_bin
MIB=$((1024 * 1024))
mk_sparse a.img 64M
mk_sparse b.img 48M
mk_sparse cache.img 64M
create_cache cache.img a.img --name a --mode write-back --sequential-cutoff 0
start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600

# The client on a: 100 writes of 64 KiB, each with its own pattern, 20 ms apart (about 2 s),
# on one connection that must live through the addition.
start_pattern_writer "$(nbd_uri "$SOCK" a)" 0
sleep 0.3
out=$(ssd volume add --cache cache.img --backing b.img --name b --mode write-back \
    --sequential-cutoff 0 2>&1) || fail "volume add while serving failed: $out"
assert_contains "$out" "served now as NBD export 'b'" "the addition went through the daemon"
finish_pattern_writer addition
grep -q "volume 'b' added while serving" "$SERVER_LOG" || fail "the daemon's log does not record the addition"

list=$(nbdinfo --list --json "$(nbd_uri "$SOCK")") || fail "nbdinfo --list failed"
assert_eq "$(jq -r '[.exports[]["export-name"]] | sort | join(",")' <<<"$list")" "a,b" "exports after the addition"
assert_eq "$(jq -r '.exports[] | select(.["export-name"] == "b") | .["export-size"]' <<<"$list")" \
    $((48 * MIB)) "size of the new export"

head -c 4M /dev/urandom >want-b.bin
qemu-io -f raw -c "write -s want-b.bin 1M 4M" "$(nbd_uri "$SOCK" b)" >/dev/null || fail "write to b"
qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" b)" got-b.img || fail "copy of b"
cmp -n $((4 * MIB)) -i "$MIB":0 got-b.img want-b.bin || fail "b does not read back what was written to it"
check_a() { check_pattern_writes "$(nbd_uri "$SOCK" a)" 0 "$1"; }
check_a "made during the addition"
s=$(stats_json cache.img)
assert_eq "$(jq -r '[.volumes[].name] | join(",")' <<<"$s")" "a,b" "stats lists the new volume"
assert_eq "$(jq '[.volumes[].lines_used] | add' <<<"$s")" "$(jq .cache_used_lines <<<"$s")" \
    "per-volume lines add up to the cache's"
assert_eq "$(jq '[.volumes[].dirty_lines] | add' <<<"$s")" "$(jq .cache_dirty_lines <<<"$s")" \
    "per-volume dirty lines add up to the cache's"
assert_gt "$(vol_field "$s" b dirty_bytes)" 0 "dirty data on the new write-back volume"
cmp -n $((4 * MIB)) -i "$MIB":0 b.img want-b.bin >/dev/null 2>&1 &&
    fail "b's backing file already has its write-back data (it should be in the cache only)"

# Refusals while serving: nothing changes.
mk_sparse c.img 16M
expect_status 2 "a taken name" "already has a volume named 'a'" \
    "$SSDCACHE_BIN" volume add --cache cache.img --backing c.img --name a
expect_status 1 "another volume's backing device" "already the backing device of volume 'a'" \
    "$SSDCACHE_BIN" volume add --cache cache.img --backing a.img --name a2
expect_status 2 "the cache itself" "same file or device" \
    "$SSDCACHE_BIN" volume add --cache cache.img --backing cache.img --name c
expect_status 1 "a missing file" "missing.img" \
    "$SSDCACHE_BIN" volume add --cache cache.img --backing missing.img --name m
# A copy of the cache image shares its UUID, so its default control socket is this daemon's:
# the daemon refuses a request for another cache than its own (review 39).
cp --sparse=always cache.img copy.img
expect_status 1 "a copy of the served cache" "serves cache .*, not .*copy.img" \
    "$SSDCACHE_BIN" volume add --cache copy.img --backing c.img --name c
rm -f copy.img
assert_eq "$(nbdinfo --list --json "$(nbd_uri "$SOCK")" | jq -r '[.exports[]["export-name"]] | sort | join(",")')" \
    "a,b" "exports after the refusals"

# kill -9 with dirty data on both; the restart serves both from the superblock alone.
kill9_server
start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600
check_a "across kill -9"
qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" b)" after-b.img || fail "copy of b after kill -9"
cmp -n $((4 * MIB)) -i "$MIB":0 after-b.img want-b.bin || fail "b lost data across kill -9"
stop_server
ssd flush --cache cache.img >/dev/null 2>&1 || fail "flush failed"
cmp -n $((4 * MIB)) -i "$MIB":0 b.img want-b.bin || fail "b's backing file lacks its data after flush"
cmp -n $((4 * MIB)) -i "$MIB":0 a.img want-b.bin >/dev/null 2>&1 && fail "b's data reached a's backing file"
log "online volume add: ok"
