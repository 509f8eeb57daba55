#!/usr/bin/env bash
# `ssdcache volume remove` while a daemon serves the cache: a client keeps writing to another
# export over one connection throughout (every write lands, its connection is not
# interrupted); the removed volume's export is withdrawn and a client connected to it is
# disconnected; its dirty data reaches its own backing file (the other write-back volume's
# stays dirty), its device is closed (its lock released); a withdrawn removal, and one whose
# client stopped asking, serve the volume again; the only volume cannot be removed; after
# kill -9 and a restart the removed volume is gone and the others kept their data.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io qemu-img nbdinfo jq truncate cmp flock python3
require_bin
MIB=$((1024 * 1024))
mk_sparse a.img 64M
mk_sparse b.img 48M
mk_sparse c.img 32M
mk_sparse cache.img 64M
create_cache cache.img a.img --name a --mode write-back --sequential-cutoff 0
ssd volume add --cache cache.img --backing b.img --name b --mode write-back --sequential-cutoff 0 >/dev/null ||
    fail "volume add b"
ssd volume add --cache cache.img --backing c.img --name c --mode write-back --sequential-cutoff 0 >/dev/null ||
    fail "volume add c"
CTL=$TEST_DIR/ctl.sock
start_server "$TEST_DIR/nbd.sock" --cache cache.img --control "$CTL" --writeback-max-age 3600
for v in a b c; do
    head -c 4M /dev/urandom >"want-$v.bin"
    qemu-io -f raw -c "write -s want-$v.bin 1M 4M" "$(nbd_uri "$SOCK" "$v")" >/dev/null || fail "write to $v"
done
s=$(stats_json cache.img)
assert_gt "$(vol_field "$s" b dirty_bytes)" 0 "b holds dirty data before its removal"
a_dirty=$(vol_field "$s" a dirty_bytes)
assert_gt "$a_dirty" 0 "a holds dirty data"

# A client on a writes through the removal (about 2 s of writes, 20 ms apart, one connection);
# a client on b reads every 250 ms (about 10 s).
start_pattern_writer "$(nbd_uri "$SOCK" a)" $((8 * MIB))
client_cmds=()
for i in $(seq 1 40); do client_cmds+=(-c "read 0 4k" -c "sleep 250"); done
qemu-io -f raw "${client_cmds[@]}" "$(nbd_uri "$SOCK" b)" >client-b.log 2>&1 &
CLIENT_B=$!
_PIDS+=("$CLIENT_B")
sleep 0.5
out=$(timeout 60 "$SSDCACHE_BIN" volume remove --cache cache.img --name b 2>&1) ||
    fail "volume remove while serving failed: $out"
assert_contains "$out" "removed volume 'b' through the daemon" "the removal went through the daemon"
finish_pattern_writer removal
_wait_gone "$CLIENT_B" 30 || fail "the client connected to b did not end"
wait "$CLIENT_B" || true
grep -qi "failed\|error" client-b.log || fail "the client connected to b went on reading after b's removal: $(tail -3 client-b.log)"
check_a() { # the pieces written during the removal, and the first 4 MiB
    check_pattern_writes "$(nbd_uri "$SOCK" a)" $((8 * MIB)) "$1"
    qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" a)" got-a.img || fail "copy of a $1"
    cmp -n $((4 * MIB)) -i "$MIB":0 got-a.img want-a.bin || fail "a does not read back its data $1"
}
check_a "made during the removal"
grep -q "volume 'b' removed while serving" "$SERVER_LOG" || fail "the daemon's log does not record the removal"
list=$(nbdinfo --list --json "$(nbd_uri "$SOCK")") || fail "nbdinfo --list failed"
assert_eq "$(jq -r '[.exports[]["export-name"]] | sort | join(",")' <<<"$list")" "a,c" "exports after the removal"
cmp -n $((4 * MIB)) -i "$MIB":0 b.img want-b.bin || fail "b's backing file lacks its data after the removal"
flock -n b.img true || fail "b's backing file is still locked by the daemon after its removal"
cmp -n $((4 * MIB)) -i "$MIB":0 a.img want-a.bin >/dev/null 2>&1 &&
    fail "a's dirty data was written back by b's removal"
s=$(stats_json cache.img)
assert_eq "$(jq -r '[.volumes[].name] | join(",")' <<<"$s")" "a,c" "stats after the removal"
assert_eq "$(jq '[.volumes[].lines_used] | add' <<<"$s")" "$(jq .cache_used_lines <<<"$s")" \
    "per-volume lines add up to the cache's"
(( $(vol_field "$s" a dirty_bytes) >= a_dirty )) || fail "a's dirty data shrank during b's removal"

# A removal withdrawn half-way (as Ctrl-C does) serves the volume again (c's dirty data makes
# the first step return before the end).
ctl() { python3 - "$CTL" "$1" <<'PY'
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(sys.argv[2].encode() + b"\n")
print(s.makefile().readline().strip())
PY
}
first=$(ctl "{\"request\": \"volume-remove\", \"name\": \"c\", \"cache\": \"$PWD/cache.img\"}")
assert_eq "$(jq -r .done <<<"$first")" "false" "the first step of a removal is not the end: $first"
assert_eq "$(nbdinfo --list --json "$(nbd_uri "$SOCK")" | jq -r '[.exports[]["export-name"]] | sort | join(",")')" \
    "a" "c's export is withdrawn while it is being removed"
ctl "{\"request\": \"volume-remove-cancel\", \"name\": \"c\", \"cache\": \"$PWD/cache.img\"}" >/dev/null
assert_eq "$(nbdinfo --list --json "$(nbd_uri "$SOCK")" | jq -r '[.exports[]["export-name"]] | sort | join(",")')" \
    "a,c" "c is served again after the removal was withdrawn"
qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" c)" got-c.img || fail "copy of c"
cmp -n $((4 * MIB)) -i "$MIB":0 got-c.img want-c.bin || fail "c does not read back its data after the withdrawn removal"
# A removal whose client stops asking (killed, terminal closed) is withdrawn by the daemon
# (c gets dirty data again first: a removal with none finishes in its first step).
qemu-io -f raw -c "write -s want-c.bin 1M 4M" "$(nbd_uri "$SOCK" c)" >/dev/null || fail "write to c"
first=$(ctl "{\"request\": \"volume-remove\", \"name\": \"c\", \"cache\": \"$PWD/cache.img\"}")
assert_eq "$(jq -r .done <<<"$first")" "false" "c's removal is under way: $first"
exports() { nbdinfo --list --json "$(nbd_uri "$SOCK")" | jq -r '[.exports[]["export-name"]] | sort | join(",")'; }
assert_eq "$(exports)" "a" "c's export is withdrawn while it is being removed"
for ((i = 0; i < 300; i++)); do
    [[ $(exports) == "a,c" ]] && break
    sleep 0.1
done
assert_eq "$(exports)" "a,c" "c is served again once its removal's client stopped asking (within 30 s)"
grep -q "removal of volume 'c' withdrawn: its client stopped asking" "$SERVER_LOG" ||
    fail "the daemon's log does not say why c's removal was withdrawn"

# Refusals.
expect_status 1 "an unknown volume" "no volume 'zz'" \
    "$SSDCACHE_BIN" volume remove --cache cache.img --name zz
expect_status 2 "--discard-damaged with a daemon" "stopped cache" \
    "$SSDCACHE_BIN" volume remove --cache cache.img --name c --discard-damaged
out=$(timeout 60 "$SSDCACHE_BIN" volume remove --cache cache.img --name c 2>&1) || fail "removal of c: $out"
expect_status 1 "the only volume" "only volume" \
    "$SSDCACHE_BIN" volume remove --cache cache.img --name a
# b's file is free: it can be added again, as a new volume (b's slot is not reused while
# this daemon runs), and reads the data its removal wrote back.
out=$(ssd volume add --cache cache.img --backing b.img --name b2 --mode write-through 2>&1) || fail "add b2: $out"
qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" b2)" got-b2.img || fail "copy of b2"
cmp -n $((4 * MIB)) -i "$MIB":0 got-b2.img want-b.bin || fail "b2 does not read b's written-back data"

# kill -9: the removed volumes stay removed, a keeps its dirty data.
kill9_server
start_server "$TEST_DIR/nbd.sock" --cache cache.img --control "$CTL" --writeback-max-age 3600
assert_eq "$(nbdinfo --list --json "$(nbd_uri "$SOCK")" | jq -r '[.exports[]["export-name"]] | sort | join(",")')" \
    "a,b2" "exports after kill -9"
check_a "across kill -9"
stop_server
log "online volume remove: ok"
