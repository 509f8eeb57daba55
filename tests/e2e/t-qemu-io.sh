#!/usr/bin/env bash
# qemu-io: patterned writes/reads at assorted offsets and lengths (4 KiB .. 4 MiB, across 64 KiB
# line boundaries), flush, FUA, discard (reads back zeros), write-zeroes; then a graceful restart
# (SIGTERM) keeps every pattern and starts warm (read hits after restart).
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq truncate
require_bin

mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name vol0 --mode write-through --line-size 64KiB

K=1024; M=$((1024 * 1024))
# offset length pattern   (all multiples of 4 KiB)
REGIONS=(
    "0 $((4 * K)) 0x11"                             # first sector
    "$((60 * K)) $((8 * K)) 0x22"                   # crosses the first 64 KiB line boundary
    "$((M - 4 * K)) $((12 * K)) 0x33"               # crosses the 1 MiB boundary
    "$((3 * M + 4 * K)) $((M)) 0x44"                # 1 MiB starting mid-line: 17 lines touched
    "$((100 * M)) $((4 * M)) 0x55"                  # 4 MiB, line aligned
    "$((256 * M - 32 * K)) $((64 * K)) 0x66"        # one line's worth spanning two lines
    "$((512 * M - 64 * K)) $((64 * K)) 0x77"        # the very last line
    "$((300 * M + 12 * K)) $((2 * M + 8 * K)) 0x88" # odd length, odd start
)

write_cmds=(); read_cmds=()
for r in "${REGIONS[@]}"; do
    read -r off len pat <<<"$r"
    write_cmds+=("write -P $pat $off $len")
    read_cmds+=("read -P $pat $off $len")
done

verify_all() {
    qio "$URI" "${read_cmds[@]}" \
        "read -P 0x55 $((100 * M)) $((1 * M))" \
        "read -P 0xaa $((100 * M + M)) $((4 * K))" \
        "read -P 0x55 $((100 * M + M + 4 * K)) $((M - 4 * K))" \
        "read -P 0 $((100 * M + 2 * M)) $((M))" \
        "read -P 0x55 $((100 * M + 3 * M)) $((M))" \
        "read -P 0 $((200 * M)) $((2 * M))" \
        "read -P 0 $((60 * K)) $((8 * K))" \
        "read -P 0x99 $((210 * M)) $((64 * K))" \
        "read -P 0 $((400 * M)) $((M))" \
        "read -P 0 $((4 * K)) $((56 * K))" >/dev/null
}

start_server "$TEST_DIR/nbd.sock" --cache cache.img
URI=$(nbd_uri "$SOCK")

# Never-written space reads as zeros.
qio "$URI" "read -P 0 0 $((4 * M))" "read -P 0 $((400 * M)) $((M))" >/dev/null

log "writing ${#REGIONS[@]} patterned regions"
qio "$URI" "${write_cmds[@]}" "flush" >/dev/null
# Read twice: the second pass is served from the cache in write-through mode.
qio "$URI" "${read_cmds[@]}" "${read_cmds[@]}" >/dev/null
log "patterns verified"

# Partial overwrite inside a cached region, FUA write.
qio "$URI" "write -P 0xaa $((100 * M + M)) $((4 * K))" "write -f -P 0x99 $((210 * M)) $((64 * K))" >/dev/null
qio "$URI" "read -P 0x55 $((100 * M)) $((M))" "read -P 0xaa $((100 * M + M)) $((4 * K))" \
    "read -P 0x55 $((100 * M + M + 4 * K)) $((M - 4 * K))" "read -P 0x99 $((210 * M)) $((64 * K))" >/dev/null

# Discard: line aligned 1 MiB inside the 4 MiB region, and a 4 KiB-aligned range inside line 0.
qio "$URI" "read -P 0x55 $((100 * M + 2 * M)) $((M))" >/dev/null   # make sure it is cached first
qio "$URI" "discard $((100 * M + 2 * M)) $((M))" "flush" >/dev/null
qio "$URI" "read -P 0 $((100 * M + 2 * M)) $((M))" \
    "read -P 0x55 $((100 * M + 3 * M)) $((M))" "read -P 0xaa $((100 * M + M)) $((4 * K))" >/dev/null
log "discard reads back zeros, neighbours intact"

# Write zeroes: over fresh space, and over data that is cached (crossing a line boundary).
qio "$URI" "write -P 0x5a $((200 * M)) $((2 * M))" "read -P 0x5a $((200 * M)) $((2 * M))" >/dev/null
qio "$URI" "write -z $((200 * M)) $((2 * M))" "write -z $((60 * K)) $((8 * K))" >/dev/null
qio "$URI" "read -P 0 $((200 * M)) $((2 * M))" "read -P 0 $((60 * K)) $((8 * K))" \
    "read -P 0x11 0 $((4 * K))" "read -P 0x33 $((M - 4 * K)) $((12 * K))" >/dev/null
log "write-zeroes reads back zeros"

# The regions overwritten above now hold different data.
read_cmds=("${read_cmds[@]/read -P 0x22 $((60 * K)) $((8 * K))/read -P 0 $((60 * K)) $((8 * K))}")
read_cmds=("${read_cmds[@]/read -P 0x55 $((100 * M)) $((4 * M))/read -P 0x55 $((100 * M)) $((M))}")
verify_all
log "full verification before restart ok"

stats_before=$(stats_json cache.img)
log "stats (live) before restart: $(jq -c . <<<"$stats_before")"

occ_before=$(vol_field "$stats_before" vol0 occupancy_bytes)
assert_gt "$occ_before" 0 "occupancy before the graceful stop"
stop_server
start_server "$TEST_DIR/nbd.sock" --cache cache.img
st=$(stats_json cache.img)
log "stats right after the warm restart: $(jq -c . <<<"$st")"
assert_eq "$(vol_field "$st" vol0 occupancy_bytes)" "$occ_before" "occupancy kept across SIGTERM + restart (warm)"
hits0=$(vol_field "$st" vol0 read_hits)
verify_all
st=$(stats_json cache.img)
assert_gt "$(( $(vol_field "$st" vol0 read_hits) - hits0 ))" 0 "read_hits of the first verification pass after a warm restart"
verify_all
log "full verification after SIGTERM + restart ok"

st=$(stats_json cache.img)
log "stats (live) after restart + two verification passes: $(jq -c . <<<"$st")"
assert_eq "$(jq -r .source <<<"$st")" live "stats source while serving"
hits=$(vol_field "$st" vol0 read_hits)
assert_gt "$hits" 0 "read_hits after warm restart and re-read"
fromcache=$(vol_field "$st" vol0 bytes_from_cache)
assert_gt "$fromcache" 0 "bytes_from_cache after warm restart and re-read"
occ=$(vol_field "$st" vol0 occupancy_bytes)
assert_gt "$occ" 0 "occupancy after warm restart"
stop_server

# The backing alone holds every byte (write-through): compare a few regions straight from the file.
cmp_region() { # off len pattern
    local got
    got=$(dd if=backing.img bs=4096 skip=$(($1 / 4096)) count=$(($2 / 4096)) status=none | od -An -tx1 -v | tr -s ' \n' '\n' | sort -u | grep -v '^$' | tr '\n' ' ')
    assert_eq "$got" "$(printf '%02x ' "$3")" "backing content at $1+$2"
}
cmp_region 0 4096 0x11
cmp_region $((512 * M - 64 * K)) $((64 * K)) 0x77
cmp_region $((100 * M + 2 * M)) $((M)) 0
cmp_region $((300 * M + 12 * K)) $((2 * M + 8 * K)) 0x88
log "backing file holds the data (write-through)"

# ---- never stale after kill -9 ----
# Cache a region, kill -9 the daemon, change the region directly on the backing file while no
# daemon runs, restart: the cache must have been discarded, so the new bytes are what is read.
start_server "$TEST_DIR/nbd.sock" --cache cache.img
qio "$URI" "write -P 0xc1 $((150 * M)) $((M))" "read -P 0xc1 $((150 * M)) $((M))" \
    "read -P 0xc1 $((150 * M)) $((M))" "read -P 0x88 $((300 * M + 12 * K)) $((2 * M + 8 * K))" >/dev/null
st=$(stats_json cache.img)
assert_gt "$(vol_field "$st" vol0 occupancy_bytes)" 0 "occupancy before kill -9"
kill9_server
# Same file (same inode), new bytes in two cached regions.
head -c $((M)) /dev/zero | tr '\0' '\343' | dd of=backing.img bs=1M seek=150 conv=notrunc status=none
head -c $((64 * K)) /dev/zero | tr '\0' '\344' | dd of=backing.img bs=4k seek=$(((300 * M + 12 * K) / 4096)) conv=notrunc status=none
# The socket file left behind by the killed daemon must not stop the restart.
[[ -S "$TEST_DIR/nbd.sock" ]] && log "stale socket file left by the killed daemon; restarting over it"
KEEP_STALE_SOCKET=1 start_server "$TEST_DIR/nbd.sock" --cache cache.img
st=$(stats_json cache.img)
log "stats right after restart from kill -9: $(jq -c . <<<"$st")"
assert_eq "$(vol_field "$st" vol0 occupancy_bytes)" 0 "occupancy right after an unclean restart"
qio "$URI" "read -P 0xe3 $((150 * M)) $((M))" "read -P 0xe4 $((300 * M + 12 * K)) $((64 * K))" \
    "read -P 0x88 $((300 * M + 76 * K)) $((2 * M - 56 * K))" "read -P 0x11 0 $((4 * K))" >/dev/null
stop_server
log "after kill -9 the cache was discarded: data changed on the backing is what is served"
