#!/usr/bin/env bash
# fio (nbd ioengine, crc32c verify) in each cache mode: 4 KiB and 512-byte random writes and mixed 4k..1m block
# sizes, 4 jobs = 4 concurrent connections on disjoint regions; each workload is verified in-run,
# re-verified by a separate verify-only run, and re-verified again after a graceful restart.
source "$(dirname "$0")/lib.sh"
require_tool fio jq truncate
require_bin
fio --enghelp=nbd >/dev/null 2>&1 || fail "fio has no nbd ioengine"

# run_fio TAG URI EXTRA...: runs one fio invocation (JSON output), fails on exit status or any
# job error; sets FIO_W / FIO_R to the bytes written / read by all jobs.
run_fio() {
    local tag=$1 uri=$2 rc=0
    shift 2
    local out="$TEST_DIR/fio.$tag.json"
    timeout -k 10 150 fio --output-format=json --output="$out" \
        --ioengine=nbd --uri="$uri" --thread --group_reporting=0 \
        --numjobs=4 --offset_increment=64m --randrepeat=1 \
        --verify=crc32c --verify_fatal=1 --verify_dump=0 "$@" >"$TEST_DIR/fio.$tag.out" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        fail "fio $tag exited $rc:
$(cat "$TEST_DIR/fio.$tag.out")
$(jq -c '[.jobs[] | {jobname, error, w: .write.io_bytes, r: .read.io_bytes}]' "$out" 2>/dev/null || tail -c 3000 "$out")"
    fi
    sed -n '/^{/,$p' "$out" >"$out.clean"
    out="$out.clean"
    local errs jobs
    errs=$(jq '[.jobs[].error] | map(select(. != 0)) | length' "$out")
    jobs=$(jq '.jobs | length' "$out")
    FIO_R=$(jq '[.jobs[].read.io_bytes] | add' "$out")
    FIO_W=$(jq '[.jobs[].write.io_bytes] | add' "$out")
    assert_eq "$errs" 0 "fio $tag: jobs with errors"
    assert_eq "$jobs" 4 "fio $tag: number of jobs"
    if grep -qi 'verify.*fail\|bad magic\|crc32c: verify' "$TEST_DIR/fio.$tag.out"; then
        fail "fio $tag reported verify problems: $(cat "$TEST_DIR/fio.$tag.out")"
    fi
}

M=$((1024 * 1024))
DONE=0
for mode in write-back write-through write-around pass-through; do
    mk_sparse "backing-$mode.img" 512M
    mk_sparse "cache-$mode.img" 128M
    create_cache "cache-$mode.img" "backing-$mode.img" --name "vol-$mode" --mode "$mode"
    start_server "$TEST_DIR/nbd-$mode.sock" --cache "cache-$mode.img"
    URI=$(nbd_uri "$SOCK")

    # (a) 4 KiB random writes, verified after the write phase; 4 jobs at offsets 0, 64m, 128m, 192m.
    A=(--name=rand4k --rw=randwrite --bs=4k --size=8m --iodepth=8)
    # (b) mixed block sizes 4k..1m (multiples of 4k, 4k aligned), regions at 256m + n*64m.
    B=(--name=mixed --rw=randwrite --bsrange=4k-1m --blockalign=4k --size=32m --offset=256m --iodepth=4)
    # (c) 512-byte random writes, 32 in flight per job: most 4 KiB sectors get several at once,
    # each served by read-modify-write under the line lock (issue 13), regions at 48m + n*64m.
    C=(--name=rand512 --rw=randwrite --bs=512 --size=1m --offset=48m --iodepth=32)

    run_fio "$mode.a" "$URI" "${A[@]}" --do_verify=1
    assert_eq "$FIO_W" $((4 * 8 * M)) "$mode rand4k bytes written"
    assert_gt "$FIO_R" 0 "$mode rand4k bytes verified"
    run_fio "$mode.b" "$URI" "${B[@]}" --do_verify=1
    assert_eq "$FIO_W" $((4 * 32 * M)) "$mode mixed bytes written"
    assert_gt "$FIO_R" 0 "$mode mixed bytes verified"
    run_fio "$mode.c" "$URI" "${C[@]}" --do_verify=1
    assert_eq "$FIO_W" $((4 * M)) "$mode rand512 bytes written"
    log "$mode: write+verify ok"

    # Separate verify-only runs (new connections) re-read everything both workloads wrote.
    run_fio "$mode.a.v" "$URI" "${A[@]}" --verify_only
    assert_eq "$FIO_R" $((4 * 8 * M)) "$mode rand4k verify-only bytes read"
    run_fio "$mode.b.v" "$URI" "${B[@]}" --verify_only
    assert_eq "$FIO_R" $((4 * 32 * M)) "$mode mixed verify-only bytes read"
    run_fio "$mode.c.v" "$URI" "${C[@]}" --verify_only
    assert_eq "$FIO_R" $((4 * M)) "$mode rand512 verify-only bytes read"
    log "$mode: verify-only ok"

    st=$(stats_json "cache-$mode.img")
    log "$mode stats: $(jq -c . <<<"$st")"
    assert_eq "$(vol_field "$st" "vol-$mode" mode)" "$mode" "stats mode"
    assert_gt "$(vol_field "$st" "vol-$mode" writes)" 0 "$mode writes counted"
    assert_gt "$(vol_field "$st" "vol-$mode" reads)" 0 "$mode reads counted"
    if [[ $mode == pass-through ]]; then
        assert_eq "$(vol_field "$st" "vol-$mode" occupancy_bytes)" 0 "pass-through cache occupancy"
        assert_eq "$(vol_field "$st" "vol-$mode" bytes_from_cache)" 0 "pass-through bytes_from_cache"
    fi

    # Graceful restart, then everything still verifies.
    stop_server
    start_server "$TEST_DIR/nbd-$mode.sock" --cache "cache-$mode.img"
    run_fio "$mode.a.v2" "$URI" "${A[@]}" --verify_only
    run_fio "$mode.b.v2" "$URI" "${B[@]}" --verify_only
    run_fio "$mode.c.v2" "$URI" "${C[@]}" --verify_only
    log "$mode: verify-only after restart ok"
    stop_server
    DONE=$((DONE + 1))
done
assert_eq "$DONE" 4 "modes completed"
log "ok"
