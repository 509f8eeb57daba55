#!/usr/bin/env bash
# In every mode the backing holds all data (write-back: once `ssdcache flush` has written the
# dirty data back), so what the export serves must always equal the backing file. Stress that with racing readers and writers on the same lines (read fills vs
# overwrites, evictions in a minimum-size cache), with SIGTERM and with kill -9 in the middle of the
# load, then compare a full read of the export (warm or cold cache) with the backing file.
source "$(dirname "$0")/lib.sh"
require_tool fio nbdcopy cmp jq truncate
require_bin
M=$((1024 * 1024))

FIO_PID=""
# start_load URI TAG SECONDS: 4 fio jobs doing mixed random reads/writes (4k..256k) on the same
# 48 MiB, in the background (no verify: the jobs overwrite each other on purpose).
start_load() {
    timeout -k 5 $(($3 + 60)) fio --output="$TEST_DIR/fio.$2.out" --ioengine=nbd --uri="$1" --thread \
        --name=race --numjobs=4 --rw=randrw --rwmixread=60 --bsrange=4k-256k --blockalign=4k \
        --offset=16m --size=48m --iodepth=4 --time_based --runtime="$3" --norandommap \
        --randseed=$RANDOM >/dev/null 2>&1 &
    FIO_PID=$!
    _PIDS+=("$FIO_PID")
}
wait_load() { # wait_load EXPECT: "ok" (fio must succeed) or "any" (server went away under it)
    local rc=0
    wait "$FIO_PID" || rc=$?
    if [[ $1 == ok && $rc -ne 0 ]]; then
        fail "fio load exited $rc: $(tail -n 30 "$TEST_DIR/fio.$2.out")"
    fi
    [[ $rc -ne 124 && $rc -ne 137 ]] || fail "fio load had to be killed by timeout"
    FIO_PID=""
}
# compare_with_backing URI BACKING TAG: full read of the export vs the backing file itself.
compare_with_backing() {
    rm -f "$TEST_DIR/export.raw"
    timeout -k 5 120 nbdcopy "$1" "$TEST_DIR/export.raw" || fail "nbdcopy of the export failed"
    # Write-back: the backing file holds everything only once the dirty data is written back.
    timeout -k 5 120 "$SSDCACHE_BIN" flush --cache "$C" 2>"$TEST_DIR/flush.err" ||
        fail "ssdcache flush failed: $(cat "$TEST_DIR/flush.err")"
    stop_server
    if ! cmp "$TEST_DIR/export.raw" "$2" >"$TEST_DIR/cmp.out" 2>&1; then
        fail "$3: the export and the backing file differ: $(head -n 3 "$TEST_DIR/cmp.out")
(first differing bytes as served vs on the backing; $(cmp -l "$TEST_DIR/export.raw" "$2" | wc -l) bytes differ)"
    fi
    rm -f "$TEST_DIR/export.raw"
    log "$3: export == backing"
}

DONE=0
for mode in write-back write-through write-around pass-through; do
    B="$TEST_DIR/b-$mode.img"
    C="$TEST_DIR/c-$mode.img"
    mk_sparse "$B" 128M
    mk_sparse "$C" 16M
    create_cache "$C" "$B" --name vol --mode "$mode"
    start_server "$TEST_DIR/$mode.sock" --cache "$C"
    URI=$(nbd_uri "$SOCK")

    # 1. Racing load that runs to completion, then a full comparison.
    start_load "$URI" "$mode.1" 4
    wait_load ok "$mode.1"
    st=$(stats_json "$C")
    log "$mode stats after the racing load: $(jq -c '.volumes[0] | {reads, writes, read_hits, read_misses, occupancy_bytes}' <<<"$st")"
    [[ $mode == pass-through ]] || assert_gt "$(vol_field "$st" vol read_hits)" 0 "$mode: read hits during the racing load"
    compare_with_backing "$URI" "$B" "$mode: after racing load"

    # 2. SIGTERM in the middle of the load: in-flight requests finish, clean stop, warm restart.
    start_server "$TEST_DIR/$mode.sock" --cache "$C"
    start_load "$URI" "$mode.2" 30
    sleep 2
    _is_ours_alive "$FIO_PID" || fail "$mode: fio load ended early: $(tail -n 20 "$TEST_DIR/fio.$mode.2.out")"
    stop_server
    wait_load any "$mode.2"
    start_server "$TEST_DIR/$mode.sock" --cache "$C"
    st=$(stats_json "$C")
    [[ $mode == pass-through ]] || assert_gt "$(vol_field "$st" vol occupancy_bytes)" 0 "$mode: warm after SIGTERM under load"
    compare_with_backing "$URI" "$B" "$mode: after SIGTERM under load, warm restart"

    # 3. kill -9 in the middle of the load: cold restart (write-back: dirty data recovered),
    # still equal.
    start_server "$TEST_DIR/$mode.sock" --cache "$C"
    start_load "$URI" "$mode.3" 30
    sleep 2
    _is_ours_alive "$FIO_PID" || fail "$mode: fio load ended early: $(tail -n 20 "$TEST_DIR/fio.$mode.3.out")"
    kill9_server
    wait_load any "$mode.3"
    start_server "$TEST_DIR/$mode.sock" --cache "$C"
    st=$(stats_json "$C")
    if [[ $mode == write-back ]]; then
        # Only the dirty data comes back (from the journal); clean lines are dropped.
        assert_eq "$(vol_field "$st" vol occupancy_bytes)" "$(vol_field "$st" vol dirty_bytes)" \
            "$mode: occupancy after kill -9 under load is the recovered dirty data"
    else
        assert_eq "$(vol_field "$st" vol occupancy_bytes)" 0 "$mode: occupancy after kill -9 under load"
    fi
    # Use it a bit before comparing, so the comparison also reads a freshly refilled cache.
    start_load "$URI" "$mode.4" 2
    wait_load ok "$mode.4"
    compare_with_backing "$URI" "$B" "$mode: after kill -9 under load, cold restart"
    rm -f "$B" "$C"
    DONE=$((DONE + 1))
done
assert_eq "$DONE" 4 "modes completed"
log "ok"
