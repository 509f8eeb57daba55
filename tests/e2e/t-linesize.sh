#!/usr/bin/env bash
# Line sizes at both ends of the range (4 KiB, 1 MiB) and in between: partial-line writes,
# sector-interleaved concurrent writes, mixed sizes, warm restart; export always equals backing.
source "$(dirname "$0")/lib.sh"
require_tool fio qemu-io nbdcopy cmp jq truncate
require_bin
K=1024; M=$((1024 * 1024))

fio_run() { # fio_run TAG URI ARGS...
    local tag=$1 uri=$2 rc=0
    shift 2
    timeout -k 10 120 fio --output="$TEST_DIR/fio.$tag.out" --ioengine=nbd --uri="$uri" --thread \
        --verify=crc32c --verify_fatal=1 "$@" >/dev/null 2>&1 || rc=$?
    [[ $rc -eq 0 ]] || fail "fio $tag exited $rc: $(tail -n 30 "$TEST_DIR/fio.$tag.out")"
}

# info --json may spell the line size in bytes; accept what create was given.
DONE=0
for ls in 4KiB 16KiB 256KiB 1MiB; do
    mk_sparse "b-$ls.img" 256M
    mk_sparse "c-$ls.img" 128M
    create_cache "c-$ls.img" "b-$ls.img" --name vol --mode write-through --line-size "$ls"
    info=$("$SSDCACHE_BIN" info --cache "c-$ls.img" --json)
    case $ls in
        *KiB) bytes=$(( ${ls%KiB} * K )) ;;
        *MiB) bytes=$(( ${ls%MiB} * M )) ;;
    esac
    jq -e --argjson b "$bytes" '[.. | objects | .line_size? | select(. == $b)] | length > 0' >/dev/null <<<"$info" ||
        fail "info --json does not show line_size $bytes for --line-size $ls: $info"
    start_server "$TEST_DIR/$ls.sock" --cache "c-$ls.img"
    URI=$(nbd_uri "$SOCK")

    # Partial-line writes around a line of this size, after the line is cached.
    L=$bytes
    base=$((64 * M))
    qio "$URI" "write -P 0x61 $base $((2 * L + 8 * K))" "read -P 0x61 $base $((2 * L + 8 * K))" >/dev/null
    qio "$URI" "write -P 0x62 $((base + L - 4 * K)) $((8 * K))" "write -P 0x63 $((base + 4 * K)) $((4 * K))" >/dev/null
    if ((L > 8 * K)); then
        qio "$URI" "read -P 0x61 $base $((4 * K))" "read -P 0x63 $((base + 4 * K)) $((4 * K))" \
            "read -P 0x61 $((base + 8 * K)) $((L - 12 * K))" "read -P 0x62 $((base + L - 4 * K)) $((8 * K))" \
            "read -P 0x61 $((base + L + 4 * K)) $((L + 4 * K))" >/dev/null
    else
        # L = 4 KiB: the 0x62 write covered sectors 0-1, then 0x63 overwrote sector 1.
        qio "$URI" "read -P 0x62 $base $((4 * K))" "read -P 0x63 $((base + 4 * K)) $((4 * K))" \
            "read -P 0x61 $((base + 8 * K)) $((8 * K))" >/dev/null
    fi

    # Sector-interleaved writes from 4 connections into the same lines, then mixed sizes.
    fio_run "$ls.il" "$URI" --name=il --numjobs=4 --offset=128m --offset_increment=4k --size=4m \
        --rw=write:12k --bs=4k --iodepth=8 --do_verify=1
    fio_run "$ls.mix" "$URI" --name=mix --numjobs=2 --offset=160m --offset_increment=32m --size=24m \
        --rw=randwrite --bsrange=4k-1m --blockalign=4k --iodepth=4 --do_verify=1
    stop_server
    start_server "$TEST_DIR/$ls.sock" --cache "c-$ls.img"
    fio_run "$ls.il.v" "$URI" --name=il --numjobs=4 --offset=128m --offset_increment=4k --size=4m \
        --rw=write:12k --bs=4k --iodepth=8 --verify_only
    fio_run "$ls.mix.v" "$URI" --name=mix --numjobs=2 --offset=160m --offset_increment=32m --size=24m \
        --rw=randwrite --bsrange=4k-1m --blockalign=4k --iodepth=4 --verify_only
    st=$(stats_json "c-$ls.img")
    assert_gt "$(vol_field "$st" vol read_hits)" 0 "line size $ls: read hits after warm restart"
    rm -f export.raw
    timeout -k 5 120 nbdcopy "$URI" export.raw
    stop_server
    cmp export.raw "b-$ls.img" || fail "line size $ls: export differs from the backing"
    rm -f export.raw "b-$ls.img" "c-$ls.img"
    log "line size $ls ok"
    DONE=$((DONE + 1))
done
assert_eq "$DONE" 4 "line sizes completed"
log "ok"
