#!/usr/bin/env bash
# `stats --json` (live, then offline) and `info --json` report what was actually done.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq truncate
require_bin
M=$((1024 * 1024))

mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name vol0 --mode write-through --line-size 64KiB --policy s3fifo

# info --json: volume name, mode, line size (searched anywhere in the document, any nesting).
info=$("$SSDCACHE_BIN" info --cache cache.img --json) || fail "info --json failed: $info"
jq -e . >/dev/null <<<"$info" || fail "info --json is not JSON: $info"
log "info --json: $(jq -c . <<<"$info")"
jq -e '[.. | objects | select(.name? == "vol0")] | length > 0' >/dev/null <<<"$info" ||
    fail "info --json lacks the volume name vol0: $info"
jq -e '[.. | strings] | index("write-through") != null' >/dev/null <<<"$info" ||
    fail "info --json lacks the mode write-through: $info"
jq -e '[paths(scalars) as $p | select(($p[-1] | tostring | test("line"; "i")) and ((getpath($p) == 65536) or (getpath($p) | tostring | test("^64 ?KiB$"; "i"))))] | length > 0' >/dev/null <<<"$info" ||
    fail "info --json lacks a line size of 65536: $info"
assert_eq "$(jq -r '.volumes[0].policy' <<<"$info")" s3fifo "info --json policy (create --policy s3fifo)"
txt=$("$SSDCACHE_BIN" info --cache cache.img) || fail "info failed: $txt"
assert_contains "$txt" vol0 "info (text)"

start_server "$TEST_DIR/nbd.sock" --cache cache.img
URI=$(nbd_uri "$SOCK")
s0=$(stats_json cache.img)
log "stats at start: $(jq -c . <<<"$s0")"
assert_eq "$(jq -r .source <<<"$s0")" live "stats source while serving"
assert_eq "$(vol_field "$s0" vol0 mode)" write-through "stats mode"
assert_eq "$(vol_field "$s0" vol0 occupancy_bytes)" 0 "occupancy of a fresh cache"
lines=$(jq -r .lines <<<"$s0")
assert_eq "$(jq -r .dirty_limit_lines <<<"$s0")" $((lines * 80 / 100)) "the default dirty limit: 80% of $lines lines"

F=(reads writes read_hits read_misses bytes_from_cache bytes_from_backing bytes_to_cache bytes_to_backing occupancy_bytes)
declare -A B
for f in "${F[@]}"; do B[$f]=$(vol_field "$s0" vol0 "$f"); done

# One 1 MiB write; then the same (never written) 1 MiB read three times.
qio "$URI" "write -P 0x3c $((8 * M)) $((M))" "flush" >/dev/null
s1=$(stats_json cache.img)
d() { echo $(( $(vol_field "$1" vol0 "$2") - B[$2] )); }
log "after 1 MiB write: $(jq -c . <<<"$s1")"
assert_gt "$(d "$s1" writes)" 0 "writes after a 1 MiB write"
assert_gt "$(d "$s1" bytes_to_backing)" $((M - 1)) "bytes_to_backing after a 1 MiB write-through write"
assert_eq "$(d "$s1" reads)" 0 "reads after writes only"

for pass in 1 2 3; do
    qio "$URI" "read -P 0 $((64 * M)) $((M))" >/dev/null
done
s2=$(stats_json cache.img)
log "after reading the same 1 MiB three times: $(jq -c . <<<"$s2")"
assert_gt "$(d "$s2" reads)" 2 "reads after three 1 MiB reads"
assert_gt "$(d "$s2" read_hits)" 0 "read_hits after re-reading the same 1 MiB"
assert_gt "$(d "$s2" read_misses)" 0 "read_misses of the first (cold) read"
assert_gt "$(d "$s2" bytes_from_cache)" $((M - 1)) "bytes_from_cache after re-reading 1 MiB"
assert_gt "$(d "$s2" bytes_from_backing)" 0 "bytes_from_backing of the first (cold) read"
assert_gt "$(vol_field "$s2" vol0 occupancy_bytes)" 0 "occupancy after caching reads"
# bytes moved can never exceed what was asked: 3 MiB read in total (allow line rounding: 2x).
tot=$(( $(d "$s2" bytes_from_cache) + $(d "$s2" bytes_from_backing) ))
(( tot >= 3 * M && tot <= 6 * M )) || fail "bytes_from_cache+bytes_from_backing=$tot for 3 MiB of reads"

# Reading the written 1 MiB hits (write-through caches what it writes, or the first read does).
qio "$URI" "read -P 0x3c $((8 * M)) $((M))" "read -P 0x3c $((8 * M)) $((M))" >/dev/null
s3=$(stats_json cache.img)
assert_gt "$(( $(vol_field "$s3" vol0 read_hits) - $(vol_field "$s2" vol0 read_hits) ))" 0 "hits reading back written data"

info=$(timeout 30 "$SSDCACHE_BIN" info --cache cache.img --json) || fail "info --json while serving failed: $info"
jq -e '[.. | objects | select(.name? == "vol0")] | length > 0' >/dev/null <<<"$info" ||
    fail "info --json while serving lacks vol0: $info"
txt=$("$SSDCACHE_BIN" stats --cache cache.img) || fail "stats (text) failed: $txt"
assert_contains "$txt" vol0 "stats (text)"
stop_server

# Offline: the persisted counters equal the last live ones.
off=$(stats_json cache.img)
log "stats offline: $(jq -c . <<<"$off")"
assert_eq "$(jq -r .source <<<"$off")" offline "stats source after SIGTERM"
for f in reads writes read_hits bytes_from_cache bytes_to_backing occupancy_bytes; do
    assert_eq "$(vol_field "$off" vol0 "$f")" "$(vol_field "$s3" vol0 "$f")" "offline $f vs last live value"
done

# And they keep counting from there after a restart (warm: occupancy kept).
start_server "$TEST_DIR/nbd.sock" --cache cache.img
s4=$(stats_json cache.img)
log "stats after warm restart: $(jq -c . <<<"$s4")"
assert_eq "$(vol_field "$s4" vol0 occupancy_bytes)" "$(vol_field "$s3" vol0 occupancy_bytes)" "occupancy after a clean restart"
# SIGINT is a graceful stop too: exit 0, and the next start is warm.
stop_server "$SERVER_PID" INT
start_server "$TEST_DIR/nbd.sock" --cache cache.img
s5=$(stats_json cache.img)
assert_eq "$(vol_field "$s5" vol0 occupancy_bytes)" "$(vol_field "$s3" vol0 occupancy_bytes)" "occupancy after SIGINT + restart"
qio "$URI" "read -P 0x3c $((8 * M)) $((M))" >/dev/null
stop_server
log "ok"
