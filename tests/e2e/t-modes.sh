#!/usr/bin/env bash
# Per mode (write-back, write-through, write-around, pass-through): overwrites of cached data are never stale
# (partial-line and multi-line overwrites, trim, write-zeroes, FUA), mode semantics show in the
# stats (write-around writes do not fill the cache; pass-through never uses it), and 4 connections
# writing interleaved 4 KiB sectors of the same 64 KiB lines at once lose no update.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io fio jq truncate
require_bin
K=1024; M=$((1024 * 1024))

DONE=0
for mode in write-back write-through write-around pass-through; do
    mk_sparse "b-$mode.img" 512M
    mk_sparse "c-$mode.img" 64M
    create_cache "c-$mode.img" "b-$mode.img" --name vol --mode "$mode"
    start_server "$TEST_DIR/$mode.sock" --cache "c-$mode.img"
    URI=$(nbd_uri "$SOCK")

    # Fill 2 MiB, read it twice (caches it unless pass-through).
    qio "$URI" "write -P 0x10 $((32 * M)) $((2 * M))" "read -P 0x10 $((32 * M)) $((2 * M))" \
        "read -P 0x10 $((32 * M)) $((2 * M))" >/dev/null
    st=$(stats_json "c-$mode.img")
    occ1=$(vol_field "$st" vol occupancy_bytes)
    case $mode in
        pass-through) assert_eq "$occ1" 0 "$mode: occupancy after reads" ;;
        *) assert_gt "$occ1" 0 "$mode: occupancy after reading 2 MiB twice" ;;
    esac

    # Overwrite inside cached lines: one sector, a line-crossing 12 KiB, a whole line, FUA.
    qio "$URI" "write -P 0x21 $((32 * M + 8 * K)) $((4 * K))" \
        "write -P 0x22 $((32 * M + 60 * K)) $((12 * K))" \
        "write -P 0x23 $((32 * M + 256 * K)) $((64 * K))" \
        "write -f -P 0x24 $((32 * M + M)) $((4 * K))" >/dev/null
    qio "$URI" "read -P 0x10 $((32 * M)) $((8 * K))" \
        "read -P 0x21 $((32 * M + 8 * K)) $((4 * K))" \
        "read -P 0x10 $((32 * M + 12 * K)) $((48 * K))" \
        "read -P 0x22 $((32 * M + 60 * K)) $((12 * K))" \
        "read -P 0x10 $((32 * M + 72 * K)) $((184 * K))" \
        "read -P 0x23 $((32 * M + 256 * K)) $((64 * K))" \
        "read -P 0x24 $((32 * M + M)) $((4 * K))" \
        "read -P 0x10 $((32 * M + M + 4 * K)) $((M - 4 * K))" >/dev/null
    # Trim and write-zeroes over cached data, sub-line and multi-line.
    qio "$URI" "discard $((32 * M + 512 * K)) $((128 * K))" "write -z $((32 * M + 1536 * K)) $((8 * K))" \
        "write -z $((32 * M + 1600 * K)) $((192 * K))" >/dev/null
    qio "$URI" "read -P 0 $((32 * M + 512 * K)) $((128 * K))" \
        "read -P 0x10 $((32 * M + 640 * K)) $((64 * K))" \
        "read -P 0x10 $((32 * M + 1532 * K)) $((4 * K))" \
        "read -P 0 $((32 * M + 1536 * K)) $((8 * K))" \
        "read -P 0x10 $((32 * M + 1544 * K)) $((56 * K))" \
        "read -P 0 $((32 * M + 1600 * K)) $((192 * K))" \
        "read -P 0x10 $((32 * M + 1792 * K)) $((256 * K))" >/dev/null
    log "$mode: overwrites/trim/zeroes of cached data read back correctly"

    # Writes to a never-read region: write-around and pass-through do not fill the cache.
    st=$(stats_json "c-$mode.img")
    occ2=$(vol_field "$st" vol occupancy_bytes)
    qio "$URI" "write -P 0x30 $((128 * M)) $((4 * M))" >/dev/null
    st=$(stats_json "c-$mode.img")
    occ3=$(vol_field "$st" vol occupancy_bytes)
    case $mode in
        write-through | write-back) assert_gt "$occ3" "$occ2" "$mode: occupancy after writing 4 MiB of new data" ;;
        write-around | pass-through) assert_eq "$occ3" "$occ2" "$mode: occupancy after writing 4 MiB of new data" ;;
    esac
    [[ $mode != pass-through ]] || assert_eq "$(vol_field "$st" vol bytes_to_cache)" 0 "$mode: bytes_to_cache"

    # 4 connections, each writing every 4th 4 KiB sector of the same lines, concurrently; the
    # region is read first so the lines are cached (where the mode caches) while being written.
    qio "$URI" "read -P 0 $((200 * M)) $((8 * M))" "read -P 0 $((200 * M)) $((8 * M))" >/dev/null
    for round in 1 2; do
        rc=0
        timeout -k 10 120 fio --output="$TEST_DIR/fio.$mode.$round.out" --ioengine=nbd --uri="$URI" --thread \
            --name=interleave --numjobs=4 --offset=200m --offset_increment=4k --size=8m \
            --rw=write:12k --bs=4k --iodepth=16 --verify=crc32c --do_verify=1 --verify_fatal=1 \
            --randseed=$round >/dev/null 2>&1 || rc=$?
        [[ $rc -eq 0 ]] || fail "$mode: interleaved fio round $round exited $rc: $(tail -n 30 "$TEST_DIR/fio.$mode.$round.out")"
        # Every job's sectors are still intact after all jobs finished (fresh connections).
        rc=0
        timeout -k 10 120 fio --output="$TEST_DIR/fio.$mode.$round.v.out" --ioengine=nbd --uri="$URI" --thread \
            --name=interleave --numjobs=4 --offset=200m --offset_increment=4k --size=8m \
            --rw=write:12k --bs=4k --iodepth=16 --verify=crc32c --verify_only --verify_fatal=1 \
            --randseed=$round >/dev/null 2>&1 || rc=$?
        [[ $rc -eq 0 ]] || fail "$mode: interleaved verify-only round $round exited $rc: $(tail -n 30 "$TEST_DIR/fio.$mode.$round.v.out")"
        grep -q 'io=' "$TEST_DIR/fio.$mode.$round.v.out" || fail "$mode: verify-only did no I/O"
    done
    log "$mode: interleaved concurrent sector writes into shared lines: no lost updates"

    # Everything again after a graceful restart.
    stop_server
    start_server "$TEST_DIR/$mode.sock" --cache "c-$mode.img"
    qio "$URI" "read -P 0x21 $((32 * M + 8 * K)) $((4 * K))" "read -P 0x22 $((32 * M + 60 * K)) $((12 * K))" \
        "read -P 0 $((32 * M + 512 * K)) $((128 * K))" "read -P 0x30 $((128 * M)) $((4 * M))" \
        "read -P 0x10 $((32 * M + 1792 * K)) $((256 * K))" >/dev/null
    rc=0
    timeout -k 10 120 fio --output="$TEST_DIR/fio.$mode.restart.out" --ioengine=nbd --uri="$URI" --thread \
        --name=interleave --numjobs=4 --offset=200m --offset_increment=4k --size=8m \
        --rw=write:12k --bs=4k --iodepth=16 --verify=crc32c --verify_only --verify_fatal=1 \
        --randseed=2 >/dev/null 2>&1 || rc=$?
    [[ $rc -eq 0 ]] || fail "$mode: verify-only after restart exited $rc: $(tail -n 30 "$TEST_DIR/fio.$mode.restart.out")"
    # Overwrite / trim lines that came back warm from the saved map, then restart once more.
    qio "$URI" "write -P 0x41 $((32 * M)) $((16 * K))" "discard $((32 * M + 256 * K)) $((64 * K))" \
        "write -P 0x42 $((32 * M + 1792 * K)) $((4 * K))" >/dev/null
    qio "$URI" "read -P 0x41 $((32 * M)) $((16 * K))" "read -P 0 $((32 * M + 256 * K)) $((64 * K))" \
        "read -P 0x42 $((32 * M + 1792 * K)) $((4 * K))" "read -P 0x10 $((32 * M + 1796 * K)) $((252 * K))" >/dev/null
    stop_server
    start_server "$TEST_DIR/$mode.sock" --cache "c-$mode.img"
    qio "$URI" "read -P 0x41 $((32 * M)) $((16 * K))" "read -P 0 $((32 * M + 256 * K)) $((64 * K))" \
        "read -P 0x42 $((32 * M + 1792 * K)) $((4 * K))" "read -P 0x10 $((32 * M + 1796 * K)) $((252 * K))" \
        "read -P 0x24 $((32 * M + M)) $((4 * K))" >/dev/null
    stop_server
    log "$mode: ok after restart"
    DONE=$((DONE + 1))
done
assert_eq "$DONE" 4 "modes completed"
log "ok"
