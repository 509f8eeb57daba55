#!/usr/bin/env bash
# A missing backing device takes only its own volume offline (issue 12 item 1): with dirty
# data on two write-back volumes and one disk gone after a kill -9, `serve` starts, serves the
# others, says which volume is offline and why (log, stats, metrics), never touches the missing
# one's data, and `flush` writes back what it can. Once the disk is back, a restart serves the
# offline volume's data as it was and writes it back; one that appears within --backing-wait
# is served. A device given with --backing that fails, one held by another program, or every
# volume missing, still refuses the start; a mode change of another volume is not held up.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io qemu-img nbdinfo jq truncate cmp curl python3 flock
require_bin
MIB=$((1024 * 1024))
mk_sparse a.img 32M
mk_sparse b.img 32M
mk_sparse c.img 32M
mk_sparse cache.img 64M
create_cache cache.img a.img --name a --mode write-back
ssd volume add --cache cache.img --backing b.img --name b --mode write-back >/dev/null || fail "volume add b"
ssd volume add --cache cache.img --backing c.img --name c --mode write-through >/dev/null || fail "volume add c"

start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600
for v in a b c; do
    head -c 4M /dev/urandom >"want-$v.bin"
    qemu-io -f raw -c "write -s want-$v.bin 1M 4M" "$(nbd_uri "$SOCK" "$v")" >/dev/null || fail "write to $v"
done
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
# b's disk is gone (a reboot without it). Its 4 MiB of dirty data are only in the cache.
mv b.img b-away.img
cp b-away.img b-before.img

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
# b's path is in the config file's [backing] table: that counts as its recorded path (a
# missing device there takes the volume offline; only one given by flag is required).
cat >conf.toml <<TOML
[backing]
b = "$TEST_DIR/b.img"
TOML
start_server "$TEST_DIR/nbd.sock" --config conf.toml --cache cache.img --writeback-max-age 3600 \
    --metrics "127.0.0.1:$PORT" --backing-wait 1
grep -q "volume 'b' is OFFLINE" "$SERVER_LOG" || fail "the log does not say b is offline: $(cat "$SERVER_LOG")"
grep -q "b.img" "$SERVER_LOG" || fail "the log does not name b's missing device"
exports=$(nbdinfo --list "nbd+unix:///?socket=$SOCK" 2>&1) || fail "nbdinfo --list: $exports"
assert_contains "$exports" "export=\"a\"" "export a listed"
assert_contains "$exports" "export=\"c\"" "export c listed"
grep -q 'export="b"' <<<"$exports" && fail "offline volume b is exported: $exports"
for v in a c; do
    qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" "$v")" "got-$v.img" || fail "copy of $v"
    cmp -n $((4 * MIB)) -i $MIB:0 "got-$v.img" "want-$v.bin" || fail "export $v lost data across kill -9 with b missing"
done
s=$(stats_json cache.img)
assert_eq "$(vol_field "$s" b state)" "offline, backing device unavailable" "b's state in stats"
assert_eq "$(vol_field "$s" b dirty_bytes)" $((4 * MIB)) "b's dirty data kept"
assert_eq "$(vol_field "$s" a state)" "healthy" "a's state"
scrape=$(curl -sf "http://127.0.0.1:$PORT/metrics") || fail "no metrics"
assert_contains "$scrape" 'ssdcache_volume_state{volume="b",state="offline"} 1' "b offline in the metrics"
# flush writes back a (c is write-through) and ends, telling that b's data waits.
out=$(ssd flush --cache cache.img 2>&1) || fail "flush with b offline: $out"
assert_contains "$out" "offline volumes" "flush names what it left"
s=$(stats_json cache.img)
assert_eq "$(vol_field "$s" a dirty_bytes)" 0 "a written back"
assert_eq "$(vol_field "$s" b dirty_bytes)" $((4 * MIB)) "b's dirty data still kept"
cmp -n $((4 * MIB)) -i $MIB:0 a.img want-a.bin || fail "a's backing file lacks its data after flush"
# The oldest-dirty-age metric counts the offline volume's waiting data.
sleep 2
age=$(jq -r '.oldest_dirty_age_seconds // empty' <<<"$(stats_json cache.img)")
assert_gt "${age:-0}" 0 "oldest dirty age with only the offline volume's data dirty"
# A mode change of another volume is not held up by b's dirty data.
ssd set-mode --cache cache.img --volume a --mode write-through >/dev/null 2>&1 || fail "set-mode of a with b offline"
s=$(stats_json cache.img)
assert_eq "$(vol_field "$s" a mode)" "write-through" "a's mode after set-mode"
stop_server
cmp b-away.img b-before.img || fail "b's disk changed while it was away"

# Refusals: a --backing given for b that fails, every volume missing, and a device that is
# there but held by another program (serving the others while it is in use elsewhere would
# invite writes behind the cache).
expect_status 1 "a --backing that fails" "backing device of volume 'b'" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --backing b=/nonexistent/b.img
mv a.img a-away.img
mv c.img c-away.img
expect_status 1 "every volume missing" "backing device of volume 'a'" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --backing-wait 0
mv a-away.img a.img
mv c-away.img c.img
cp b-away.img b.img
flock b.img sleep 20 &
HOLDER=$!
_PIDS+=("$HOLDER")
sleep 0.5
expect_status 1 "b's device held by another program" "volume 'b'" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/x.sock" --backing-wait 0
kill "$HOLDER"
wait "$HOLDER" 2>/dev/null || true
rm b.img

# A stop asked for while serve waits for b's disk ends the wait at once, before the cache is
# opened: exit status 0 within seconds, the cache still marked cleanly stopped.
"$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/w.sock" --backing-wait 60 >wait.log 2>&1 &
WAITER=$!
_PIDS+=("$WAITER")
for _ in $(seq 1 50); do grep -q "waiting up to 60 s" wait.log && break; sleep 0.1; done
grep -q "waiting up to 60 s" wait.log || fail "serve did not start waiting: $(cat wait.log)"
kill -TERM "$WAITER"
t0=$SECONDS
rc=0
wait "$WAITER" || rc=$?
assert_eq "$rc" 0 "exit status of a serve stopped while waiting for a disk"
(( SECONDS - t0 <= 5 )) || fail "serve took $((SECONDS - t0)) s to stop while waiting for a disk"
grep -q "stopped before the cache was opened" wait.log || fail "no word of the stop: $(cat wait.log)"
assert_eq "$("$SSDCACHE_BIN" info --cache cache.img --json | jq -r .state)" clean "cache state after that stop"

# The disk comes back while serve waits for it (--backing-wait): b is served, not offline.
(sleep 2; mv b-away.img b.img) &
MOVER=$!
_PIDS+=("$MOVER")
start_server "$TEST_DIR/nbd.sock" --cache cache.img --writeback-max-age 3600 --backing-wait 20
wait "$MOVER" || fail "could not put b's disk back"
grep -q "waiting up to 20 s" "$SERVER_LOG" || fail "serve did not say it waits for b: $(cat "$SERVER_LOG")"
grep -q "OFFLINE" "$SERVER_LOG" && fail "a volume is still offline: $(cat "$SERVER_LOG")"
qemu-img convert -f raw -O raw "$(nbd_uri "$SOCK" b)" got-b.img || fail "copy of b"
cmp -n $((4 * MIB)) -i $MIB:0 got-b.img want-b.bin || fail "b lost data while offline"
ssd flush --cache cache.img >/dev/null 2>&1 || fail "flush"
cmp -n $((4 * MIB)) -i $MIB:0 b.img want-b.bin || fail "b's backing file lacks its data after flush"
stop_server
