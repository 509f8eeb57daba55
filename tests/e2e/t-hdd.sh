#!/usr/bin/env bash
# The HDD model served over NBD (`ssdcache hdd-emulator`) keeps data and is as slow as a hard
# drive; `serve --emulate-hdd` puts it under the cache and data still round-trips.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io fio python3 truncate
require_bin

mk_sparse disk.img 256M
HDD_SOCK=$TEST_DIR/hdd.sock
HDD_LOG=$TEST_DIR/hdd.log
"$SSDCACHE_BIN" hdd-emulator --file disk.img --socket "$HDD_SOCK" >"$HDD_LOG" 2>&1 &
HDD_PID=$!
_PIDS+=("$HDD_PID")
_LOG_OF[$HDD_PID]=$HDD_LOG
for ((i = 0; i < 100; i++)); do [[ -S "$HDD_SOCK" ]] && break; sleep 0.1; done
[[ -S "$HDD_SOCK" ]] || fail "hdd-emulator did not start: $(cat "$HDD_LOG")"
assert_contains "$(cat "$HDD_LOG")" "7200 rpm" "emulator log names the model"

uri=$(nbd_uri "$HDD_SOCK")
qio "$uri" "write -P 0x5a 1M 64k" "write -P 0xa5 200M 4k" >/dev/null
qio "$uri" "read -P 0x5a 1M 64k" "read -P 0xa5 200M 4k" >/dev/null
cmp -s <(dd if=disk.img bs=4k skip=$((200 * 256)) count=1 status=none) <(head -c 4096 /dev/zero | tr '\0' '\245') ||
    fail "the emulated disk did not store the data in its file"

# Random 4 KiB reads at queue depth 1 over the whole (full-stroke) disk: a 7200 rpm drive
# does about 79 per second; allow a wide band for a busy machine, but not SSD speeds.
out=$(timeout 60 fio --name=qd1 --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=1 \
    --size=256M --time_based --runtime=3 --output-format=json 2>/dev/null)
iops=$(python3 -c 'import json,sys; t=sys.stdin.read(); print(int(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))' <<<"$out")
log "HDD model, random 4 KiB QD1: $iops IOPS"
(( iops >= 40 && iops <= 110 )) || fail "HDD model gave $iops random 4 KiB IOPS at QD1, expected about 79"
kill -TERM "$HDD_PID"
_wait_gone "$HDD_PID" 20 || fail "hdd-emulator did not stop on SIGTERM"

expect_fail_stderr "zero rpm" "rpm" "$SSDCACHE_BIN" hdd-emulator --file disk.img --socket "$TEST_DIR/bad.sock" --rpm 0

# The same model under the cache.
mk_sparse cache.img 64M
create_cache cache.img disk.img --name slow
start_server "$TEST_DIR/nbd.sock" --cache cache.img --emulate-hdd
assert_contains "$(cat "$SERVER_LOG")" "hard drive" "serve log says the backing is emulated"
uri=$(nbd_uri "$SOCK")
qio "$uri" "read -P 0x5a 1M 64k" "write -P 0x33 8M 1M" "read -P 0x33 8M 1M" >/dev/null
stop_server
cmp -s <(dd if=disk.img bs=1M skip=8 count=1 status=none) <(head -c 1048576 /dev/zero | tr '\0' '\063') ||
    fail "a write through the cache did not reach the emulated disk"
