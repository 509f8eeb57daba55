#!/usr/bin/env bash
# `ssdcache volume add`: one cache, three backing files, three exports in mixed modes served
# at once; each export's data lands on its own backing device only; stats per volume add up to
# the cache's; kill -9 with dirty data on two write-back volumes and a restart lose nothing;
# refusals (a name or backing device in use, a --control no daemon answers on) name the problem.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io qemu-img jq truncate cmp
require_bin
mk_sparse a.img 64M
mk_sparse b.img 48M
mk_sparse c.img 32M
mk_sparse cache.img 64M
create_cache cache.img a.img --name a --mode write-back
ssd volume add --cache cache.img --backing b.img --name b --mode write-through >/dev/null || fail "volume add b failed"
ssd volume add --cache cache.img --backing c.img --name c --mode write-back --sequential-cutoff 0 >/dev/null ||
    fail "volume add c failed"
expect_status 2 "a second volume named b" "already has a volume named 'b'" \
    "$SSDCACHE_BIN" volume add --cache cache.img --backing "$(mk_sparse d.img 16M; echo d.img)" --name b
expect_status 1 "a backing device used twice" "already the backing device of volume 'a'" \
    "$SSDCACHE_BIN" volume add --cache cache.img --backing a.img --name a2
info=$("$SSDCACHE_BIN" info --cache cache.img --json)
assert_eq "$(jq -r '[.volumes[].name] | join(",")' <<<"$info")" "a,b,c" "volumes after two adds"

start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600
# (Adding while serving goes through the daemon: t-volume-add-online.) A --control socket
# no daemon answers on is refused, not taken as "no daemon, change the stopped cache".
expect_status 1 "volume add with a dead --control" "no daemon answers on control socket" \
    "$SSDCACHE_BIN" volume add --cache cache.img --backing d.img --name d --control "$TEST_DIR/none.ctl"
for v in a b c; do
    head -c 4M /dev/urandom >"want-$v.bin"
    qemu-io -f raw -c "write -s want-$v.bin 1M 4M" "$(nbd_uri "$SOCK" "$v")" >/dev/null || fail "write to $v"
done
for v in a b c; do
    qemu-io -f raw -c "read -v 1M 4M" "$(nbd_uri "$SOCK" "$v")" >/dev/null || fail "read of $v"
    qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" "$v")" "got-$v.img" || fail "copy of $v"
    cmp -n $((4 * 1024 * 1024)) -i $((1024 * 1024)):0 "got-$v.img" "want-$v.bin" || fail "export $v does not read back what was written to it"
done
s=$(stats_json cache.img)
sum=$(jq '[.volumes[].lines_used] | add' <<<"$s")
lines=$(jq .lines <<<"$s")
(( sum > 0 && sum <= lines )) || fail "per-volume lines $sum against the cache's $lines"
assert_gt "$(vol_field "$s" a dirty_bytes)" 0 "dirty data on write-back volume a"
assert_gt "$(vol_field "$s" c dirty_bytes)" 0 "dirty data on write-back volume c"
assert_eq "$(vol_field "$s" b dirty_bytes)" 0 "write-through volume b holds no dirty data"
# Write-through went to b's backing file already; a's and c's are dirty in the cache only.
cmp -n $((4 * 1024 * 1024)) -i $((1024 * 1024)):0 b.img want-b.bin || fail "b's backing file lacks its write-through data"
# kill -9 with dirty data on a and c (their writes were flushed by qemu-io at exit).
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600
for v in a b c; do
    qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" "$v")" "after-$v.img" || fail "copy of $v after kill -9"
    cmp -n $((4 * 1024 * 1024)) -i $((1024 * 1024)):0 "after-$v.img" "want-$v.bin" || fail "export $v lost data across kill -9"
done
stop_server
# Flushed offline, every backing file holds its own volume's data and nothing of the others.
ssd flush --cache cache.img >/dev/null 2>&1 || fail "flush failed"
for v in a b c; do
    cmp -n $((4 * 1024 * 1024)) -i $((1024 * 1024)):0 "$v.img" "want-$v.bin" || fail "backing file of $v lacks its data after flush"
done
