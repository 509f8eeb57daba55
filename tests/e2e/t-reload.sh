#!/usr/bin/env bash
# SIGHUP (`systemctl reload`) re-reads serve's configuration file while serving: the cache's
# and each volume's dirty limits change at once (stats shows them), a volume the file no longer
# caps is uncapped, other changes are logged as taking effect at the next start, a file that
# fails its checks changes nothing, and the daemon keeps serving throughout (SIGHUP used to
# kill it).
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
# A change of admission waits for the next start; a volume without a limit is uncapped.
cat >serve.toml <<TOML
cache = "$PWD/cache.img"
[volume.a]
admission = "2-hit"
TOML
hup "admission"
grep -q "takes effect at the next start" "$SERVER_LOG" || fail "the admission change is not logged as waiting for the next start"
assert_eq "$(limit_of_a)" "none" "a has no dirty limit of its own after the reload"
assert_server_alive
stop_server
log "reload: ok"
