#!/usr/bin/env bash
# SIGHUP (`systemctl reload`) re-reads serve's configuration file while serving: the cache's
# and each volume's dirty limits, admission, sequential cutoff and occupancy limit change at
# once (stats shows them, and the next requests follow them; admission and cutoff are kept in
# the superblock), a volume the file no longer limits is unlimited, a new replacement policy is
# logged as taking effect at the next start, a file that fails its checks changes nothing, and
# the daemon keeps serving throughout (SIGHUP used to kill it).
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq truncate
require_bin
mk_sparse a.img 32M
mk_sparse cache.img 64M
create_cache cache.img a.img --name a --mode write-back
cat >serve.toml <<TOML
cache = "$PWD/cache.img"
[volume.a]
dirty_limit = 10
TOML
start_server "$TEST_DIR/nbd.sock" --config serve.toml
limit_of_a() { jq -r '.volumes[] | select(.name == "a") | .dirty_limit_lines // "none"' <<<"$(stats_json cache.img)"; }
first=$(limit_of_a)
assert_gt "$first" 0 "a's dirty limit from the file at start"
reloads=0
hup() { # hup WHAT: SIGHUP, then wait (bounded) for the log to answer it
    reloads=$((reloads + 1))
    kill -HUP "$SERVER_PID"
    local i
    for ((i = 0; i < 100; i++)); do
        (( $(grep -c "SIGHUP: " "$SERVER_LOG") >= reloads )) && return 0
        sleep 0.1
    done
    fail "no answer in the log to SIGHUP ($1)"
}
sed -i 's/dirty_limit = 10/dirty_limit = 20/' serve.toml
hup "limit 20"
assert_server_alive
second=$(limit_of_a)
(( second >= 2 * first - 1 && second <= 2 * first + 1 )) || fail "a's limit after the reload: $second, expected about twice $first"
qemu-io -f raw -c "write -P 7 0 1M" "$(nbd_uri "$SOCK" a)" >/dev/null || fail "write after the reload"
# A file naming an unknown volume is refused whole: nothing changes.
printf '[volume.zz]\ndirty_limit = 5\n' >>serve.toml
hup "unknown volume"
grep -q "not reloaded, nothing changed" "$SERVER_LOG" || fail "a bad file was not reported"
assert_eq "$(limit_of_a)" "$second" "a's limit after a refused reload"
# Admission, cutoff and occupancy limit apply at once; a volume without a dirty limit in the
# file is uncapped; a new policy waits for the next start.
cat >serve.toml <<TOML
cache = "$PWD/cache.img"
policy = "arc"
[volume.a]
admission = "2-hit"
sequential_cutoff = 0
occupancy_limit = 10
TOML
hup "admission, cutoff, occupancy limit"
grep -q "replacement policy changes at the next start" "$SERVER_LOG" || fail "the policy change is not logged as waiting for the next start"
a_json() { jq -r ".volumes[] | select(.name == \"a\") | .$1 // \"none\"" <<<"$(stats_json cache.img)"; }
assert_eq "$(a_json dirty_limit_lines)" "none" "a has no dirty limit of its own after the reload"
assert_eq "$(a_json admission)" "2-hit" "a's admission after the reload (stats)"
assert_eq "$(a_json sequential_cutoff)" 0 "a's cutoff after the reload (stats)"
cap=$(a_json occupancy_limit_lines)
assert_gt "$cap" 0 "a's occupancy limit after the reload (stats)"
# 2-hit: a line read once is not cached, read again it is.
used=$(a_json lines_used)
qemu-io -f raw -c "read 20M 64k" "$(nbd_uri "$SOCK" a)" >/dev/null || fail "read after the reload"
assert_eq "$(a_json lines_used)" "$used" "a line read once under 2-hit"
qemu-io -f raw -c "read 20M 64k" "$(nbd_uri "$SOCK" a)" >/dev/null || fail "read after the reload"
assert_eq "$(a_json lines_used)" "$((used + 1))" "the line read twice under 2-hit"
# The occupancy limit: 24 MiB read twice (so 2-hit admits it) leaves a holding at most its cap.
for pass in 1 2; do
    qemu-io -f raw -c "read 4M 24M" "$(nbd_uri "$SOCK" a)" >/dev/null || fail "read pass $pass"
done
used=$(a_json lines_used)
(( used <= cap )) || fail "a holds $used lines, its occupancy limit is $cap"
assert_gt "$used" $((cap / 2)) "a filled most of its occupancy limit"
# `info` (the superblock) has the new admission while serving and after a stop.
assert_eq "$(jq -r '.volumes[0].admission' <<<"$("$SSDCACHE_BIN" info --cache cache.img --json)")" 2-hit "info while serving"
assert_server_alive
stop_server
assert_eq "$(jq -r '.volumes[0].admission' <<<"$("$SSDCACHE_BIN" info --cache cache.img --json)")" 2-hit "info after the stop"
assert_eq "$(jq -r '.volumes[0].sequential_cutoff' <<<"$("$SSDCACHE_BIN" info --cache cache.img --json)")" 0 "cutoff after the stop"
log "reload: ok"
