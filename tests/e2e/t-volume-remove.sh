#!/usr/bin/env bash
# `ssdcache volume remove`: with dirty data on the volume removed and on another, after a
# kill -9 and a clean restart, the removed volume's backing file ends up holding all of its
# data, the others keep theirs (the write-back one still dirty: not written back by the
# removal), a volume added afterwards in the freed slot reads its own device and never the
# removed volume's cached data, and the refusals (unknown name, only volume, a --control no
# daemon answers on) name the problem.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io qemu-img jq truncate cmp
require_bin
MIB=$((1024 * 1024))
mk_sparse a.img 32M
mk_sparse b.img 32M
mk_sparse c.img 32M
mk_sparse cache.img 64M
create_cache cache.img a.img --name a --mode write-back
ssd volume add --cache cache.img --backing b.img --name b --mode write-back --sequential-cutoff 0 >/dev/null || fail "volume add b"
ssd volume add --cache cache.img --backing c.img --name c --mode write-through >/dev/null || fail "volume add c"

start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600
for v in a b c; do
    head -c 4M /dev/urandom >"want-$v.bin"
    qemu-io -f raw -c "write -s want-$v.bin 1M 4M" "$(nbd_uri "$SOCK" "$v")" >/dev/null || fail "write to $v"
done
# (Removing while serving goes through the daemon: t-volume-remove-online.)
expect_status 1 "remove with a dead --control" "no daemon answers on control socket" \
    "$SSDCACHE_BIN" volume remove --cache cache.img --name b --control "$TEST_DIR/none.ctl"
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
expect_status 1 "remove after an unclean stop" "not stopped cleanly" \
    "$SSDCACHE_BIN" volume remove --cache cache.img --name b
start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600
stop_server
s=$(stats_json cache.img)
assert_eq "$(vol_field "$s" b dirty_bytes)" $((4 * MIB)) "b's dirty data before the removal"
a_dirty=$(vol_field "$s" a dirty_bytes)
assert_gt "$a_dirty" 0 "a's dirty data before the removal"

expect_status 2 "an unknown volume" "no volume 'x'" \
    "$SSDCACHE_BIN" volume remove --cache cache.img --name x
out=$(ssd volume remove --cache cache.img --name b 2>&1) || fail "volume remove b: $out"
assert_contains "$out" "4 MiB of dirty data to write back" "progress names what it writes back"
assert_contains "$out" "volume 'b' removed" "the removal is reported"
cmp -n $((4 * MIB)) -i $MIB:0 b.img want-b.bin || fail "b's backing file lacks its data after the removal"
info=$("$SSDCACHE_BIN" info --cache cache.img --json)
assert_eq "$(jq -r '[.volumes[].name] | join(",")' <<<"$info")" "a,c" "volumes after the removal"
s=$(stats_json cache.img)
assert_eq "$(vol_field "$s" a dirty_bytes)" "$a_dirty" "a's dirty data untouched by the removal"

# A new volume in the freed slot reads its own device (zeroes), not b's data.
mk_sparse d.img 32M
ssd volume add --cache cache.img --backing d.img --name d --mode write-back >/dev/null || fail "volume add d"
info=$("$SSDCACHE_BIN" info --cache cache.img --json)
assert_eq "$(jq -r '[.volumes[].name] | join(",")' <<<"$info")" "a,d,c" "d takes b's slot"
start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600
qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" d)" got-d.img || fail "copy of d"
cmp got-d.img d.img || fail "volume d does not read its own (empty) device"
for v in a c; do
    qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" "$v")" "got-$v.img" || fail "copy of $v"
    cmp -n $((4 * MIB)) -i $MIB:0 "got-$v.img" "want-$v.bin" || fail "export $v lost data across the removal"
done
stop_server

ssd volume remove --cache cache.img --name d >/dev/null 2>&1 || fail "volume remove d"
ssd volume remove --cache cache.img --name c >/dev/null 2>&1 || fail "volume remove c"
expect_status 2 "removing the only volume" "only volume.*detach" \
    "$SSDCACHE_BIN" volume remove --cache cache.img --name a
