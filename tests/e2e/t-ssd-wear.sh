#!/usr/bin/env bash
# The cache device's wear: bytes written counted while serving, kept in the superblock across
# a clean restart and a kill -9, the rating (`serve --ssd-tbw`) remembered, the projected
# lifetime in `stats` and the metrics, and a warning (stats and log) when it is under a year.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq curl python3 truncate
require_bin
M=$((1024 * 1024))
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port)
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-back
# A rating of 100 MB (0.0001 TB): a few MiB a few seconds apart use it up within hours.
expect_status 2 "--ssd-tbw 0" 'terabytes written above zero' "$SSDCACHE_BIN" serve --cache cache.img --ssd-tbw 0
start_server "$TEST_DIR/nbd.sock" --cache cache.img --ssd-tbw 0.0001 --metrics "127.0.0.1:$PORT"
URI=$(nbd_uri "$SOCK")
qio "$URI" "write -P 1 0 8M" "flush" >/dev/null
s=$(stats_json cache.img)
written=$(jq -r .ssd.bytes_written <<<"$s")
log "after 8 MiB written: $(jq -c .ssd <<<"$s")"
assert_gt "$written" $((8 * M - 1)) "cache device bytes written after an 8 MiB write-back write"
assert_eq "$(jq -r .ssd.tbw_bytes <<<"$s")" 100000000 "the rating in bytes"
# The wear sampler runs every 10 s: its warning reaches the log once it sees the rate.
for i in $(seq 1 30); do
    grep -q "endurance rating" "$SERVER_LOG" && break
    qio "$URI" "write -P 2 $((i % 8))M 1M" >/dev/null
    sleep 0.5
done
grep -q "endurance rating" "$SERVER_LOG" || fail "no warning in the log about the rating running out"
txt=$("$SSDCACHE_BIN" stats --cache cache.img)
assert_contains "$txt" "cache device written" "stats shows the cache device's bytes written"
assert_contains "$txt" "WARNING: the cache device's endurance rating" "stats warns"
years=$(stats_json cache.img | jq -r .ssd.projected_lifetime_years)
python3 -c "import sys; sys.exit(0 if 0 < float('$years') < 1 else 1)" || fail "projected lifetime $years years, expected under 1"
scrape=$(curl -sf "http://127.0.0.1:$PORT/metrics")
grep -Eq '^ssdcache_cache_device_written_bytes_total [1-9]' <<<"$scrape" || fail "no bytes-written metric: $scrape"
grep -Eq '^ssdcache_cache_device_projected_lifetime_seconds [0-9]' <<<"$scrape" || fail "no projected-lifetime metric"
assert_contains "$scrape" "ssdcache_cache_device_rated_written_bytes 100000000" "the rating metric"

# A clean stop keeps the count; the rating is remembered without --ssd-tbw.
before=$(stats_json cache.img | jq -r .ssd.bytes_written)
stop_server
off=$(stats_json cache.img)
assert_eq "$(jq -r .source <<<"$off")" offline "stats after the stop"
saved=$(jq -r .ssd.bytes_written <<<"$off")
assert_gt "$saved" $((before - 1)) "bytes written saved at the clean stop (was $before while serving)"
assert_eq "$(jq -r .ssd.tbw_bytes <<<"$off")" 100000000 "the rating saved"
start_server "$TEST_DIR/nbd.sock" --cache cache.img
qio "$URI" "write -P 3 0 4M" "flush" >/dev/null
after=$(stats_json cache.img | jq -r .ssd.bytes_written)
assert_gt "$after" $((saved + 4 * M - 1)) "bytes written go on from the saved count"
assert_eq "$(stats_json cache.img | jq -r .ssd.tbw_bytes)" 100000000 "the rating after a restart without --ssd-tbw"
# kill -9: the count written with the last superblock survives (the open writes one).
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
crashed=$(stats_json cache.img | jq -r .ssd.bytes_written)
assert_gt "$crashed" $((saved - 1)) "bytes written after kill -9 (saved $saved at the clean stop)"
start_server "$TEST_DIR/nbd.sock" --cache cache.img
assert_gt "$(stats_json cache.img | jq -r .ssd.bytes_written)" $((crashed - 1)) "bytes written after the restart from kill -9"
stop_server
