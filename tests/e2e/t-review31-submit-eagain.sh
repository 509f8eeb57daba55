#!/usr/bin/env bash
# Review 31, F5: ReadRing::enter_submit takes EAGAIN (and EBUSY) from io_uring_enter for "the
# entries stay queued and the next enter (the reaper's) submits them". The reaper is already
# asleep in io_uring_enter(GETEVENTS, min_complete 1) and computed its to_submit before: with
# nothing else in flight nobody enters again, and the READ is never answered (until the
# client happens to send another hit). The failure is injected with an LD_PRELOAD shim.
source "$(dirname "$0")/lib.sh"
require_tool python3 qemu-io truncate timeout cc
require_bin
cc -shared -fPIC -o "$TEST_DIR/fail_submit.so" "$E2E_DIR/review31/fail_submit.c" -ldl
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-through
FAIL_SUBMIT_FILE="$TEST_DIR/fail-next-submit" LD_PRELOAD="$TEST_DIR/fail_submit.so" start_server "$TEST_DIR/nbd.sock" --cache cache.img
qio "$(nbd_uri "$SOCK")" "read 0 1M" >/dev/null
qio "$(nbd_uri "$SOCK")" "read 0 1M" >/dev/null
touch "$TEST_DIR/fail-next-submit"
rc=0
out=$(timeout 60 python3 "$E2E_DIR/review31/qd1_reads.py" "$SOCK" 8192 524288) || rc=$?
log "$out"
grep -h fail_submit "$SERVER_LOG" >&2 || true
stop_server
((rc == 0)) || fail "a READ whose ring submission got EAGAIN was not answered: $out"
