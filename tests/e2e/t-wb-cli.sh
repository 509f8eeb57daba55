#!/usr/bin/env bash
# Write-back from the command line: dirty data survives kill -9 and shows in info/stats;
# serve refuses a missing or different backing device while dirty data is at stake;
# create --force refuses to drop dirty data; recover writes the dirty data offline onto the
# backing device (and onto a copy with --force); set-mode online drains before leaving
# write-back; flush makes the backing file alone hold every write.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq cmp
require_bin

mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name wb --mode write-back --sequential-cutoff 0
URI=$(nbd_uri "$TEST_DIR/wb.sock" wb)

# Patterned data at scattered places, flushed: dirty in the cache only.
start_server "$TEST_DIR/wb.sock" --cache cache.img --writeback-max-age 3600
qio "$URI" "write -P 0x11 0 1M" "write -P 0x22 64M 68k" "write -P 0x33 200M 4k" "flush" >/dev/null
st=$(stats_json cache.img)
dirty=$(vol_field "$st" wb dirty_bytes)
assert_gt "$dirty" $((1 << 20)) "dirty bytes after flushed write-back writes"
cmp -s -n 4096 backing.img /dev/zero || fail "write-back data reached the backing file before writeback"
kill9_server

# Offline: info and stats read the journal and say the backing device is not consistent.
info=$(ssd info --cache cache.img)
assert_contains "$info" "NOT consistent" "info after kill -9"
assert_eq "$(ssd info --cache cache.img --json | jq '.volumes[0].dirty_bytes')" "$dirty" "info --json dirty_bytes"
st=$(stats_json cache.img)
assert_eq "$(jq -r ".volumes[0].backing_consistent" <<<"$st")" false "stats backing_consistent"

# Dirty data at stake: never served in front of a missing or different device.
mv backing.img backing.moved
expect_fail_stderr "serve with the backing device missing" "dirty data.*recover" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock"
mk_sparse backing.img 256M
expect_fail_stderr "serve with a different backing device" "not the backing device.*dirty data" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock"
rm -f backing.img
mv backing.moved backing.img
expect_fail_stderr "create --force over dirty data" "dirty data.*flush" \
    "$SSDCACHE_BIN" create --cache cache.img --backing backing.img --mode write-through --force

# The daemon restarts, recovers, serves the data; a clean stop keeps it dirty.
KEEP_STALE_SOCKET=1 start_server "$TEST_DIR/wb.sock" --cache cache.img --writeback-max-age 3600
grep -q "recovered after an unclean stop" "$SERVER_LOG" || fail "no recovery in the log: $(cat "$SERVER_LOG")"
info=$(ssd info --cache cache.img)
assert_contains "$info" "recovered" "info from the daemon shows the recovery"
qio "$URI" "read -P 0x11 0 1M" "read -P 0x22 64M 68k" "read -P 0x33 200M 4k" "read -P 0 1M 1M" >/dev/null
stop_server

# recover: offline, onto a copy of the backing device (a replacement) with --force; the
# recorded device untouched. Refused without --force.
cp --sparse=always backing.img copy.img
expect_fail_stderr "recover onto another device without --force" "not the backing device.*--force" \
    "$SSDCACHE_BIN" recover --cache cache.img --backing copy.img
cp cache.img cache.keep
out=$(ssd recover --cache cache.img --backing copy.img --force 2>&1) || fail "recover --force: $out"
assert_contains "$out" "wrote" "recover reports what it wrote"
for spec in "0x11 0 256" "0x22 16384 17" "0x33 51200 1"; do # pattern, first 4 KiB block, blocks
    set -- $spec
    cmp -s <(dd if=copy.img bs=4k skip="$2" count="$3" status=none) \
        <(head -c $(($3 * 4096)) /dev/zero | tr '\0' "\\$(printf '%03o' $(($1)))") ||
        fail "recovered copy lacks pattern $1 at block $2"
done
cmp -s -n 4096 backing.img /dev/zero || fail "recover --force onto the copy changed the recorded device"
assert_eq "$(ssd info --cache cache.img --json | jq '.volumes[0].dirty_bytes')" 0 "dirty after recover"

# recover onto the recorded device (from the saved cache), no --force needed.
mv cache.keep cache.img
out=$(ssd recover --cache cache.img --backing backing.img 2>&1) || fail "recover: $out"
cmp -s copy.img backing.img || fail "recover onto the recorded device differs from the copy"
log "recover wrote the same data onto the recorded device and onto the copy"

# set-mode online: dirty data is written back first, then the mode changes (and persists).
start_server "$TEST_DIR/wb.sock" --cache cache.img --writeback-max-age 3600
qio "$URI" "write -P 0x44 8M 2M" "flush" >/dev/null
assert_gt "$(vol_field "$(stats_json cache.img)" wb dirty_bytes)" 0 "dirty before set-mode"
out=$(timeout -k 5 120 "$SSDCACHE_BIN" set-mode --cache cache.img --mode write-through 2>&1) ||
    fail "set-mode online: $out"
st=$(stats_json cache.img)
assert_eq "$(vol_field "$st" wb dirty_bytes)" 0 "dirty after set-mode"
assert_eq "$(vol_field "$st" wb configured_mode)" write-through "mode after set-mode"
stop_server
assert_eq "$(ssd info --cache cache.img --json | jq -r '.volumes[0].mode')" write-through "mode persisted"
cmp -s <(dd if=backing.img bs=1M skip=8 count=2 status=none) \
    <(head -c 2M /dev/zero | tr '\0' '\104') || fail "set-mode did not write the dirty data back"
log "ok: kill -9 recovery, refusals, recover, set-mode"
