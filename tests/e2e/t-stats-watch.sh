#!/usr/bin/env bash
# `stats --watch` on a terminal (tmux): the screen is redrawn in place and shows the rates of a
# workload running meanwhile (reads/s, read hit ratio, bytes per second), then the watch says
# clearly when the daemon is gone and exits 1. Bad intervals are usage errors (exit 2).
source "$(dirname "$0")/lib.sh"
require_tool tmux qemu-io truncate
require_bin
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-through
start_server "$TEST_DIR/nbd.sock" --cache cache.img
URI=$(nbd_uri "$SOCK")
# The working set cached first, so the reads during the watch are hits.
qio "$URI" "read 0 16M" >/dev/null

expect_status 2 "--watch 0" 'interval must be from 0.2' "$SSDCACHE_BIN" stats --cache cache.img --watch 0
expect_status 2 "--watch with --json" 'cannot be used with' "$SSDCACHE_BIN" stats --cache cache.img --watch 1 --json
expect_status 2 "--count without --watch" 'watch' "$SSDCACHE_BIN" stats --cache cache.img --count 3

SESSION="ssdcache-watch-$$"
tmux -L "$SESSION" new-session -d -s watch -x 120 -y 50 \
    "'$SSDCACHE_BIN' stats --cache '$TEST_DIR/cache.img' --watch 0.5; echo \"watch exited \$?\"; sleep 30"
cleanup_tmux() { tmux -L "$SESSION" kill-server 2>/dev/null || true; }
# The tmux server is ours: the harness's cleanup stops it whatever happens.
_PIDS+=("$(tmux -L "$SESSION" display-message -p '#{pid}')")
screen() { tmux -L "$SESSION" capture-pane -p -t watch; }

# A bounded workload: rounds of 40 random 4 KiB reads of the cached 16 MiB, 0.3 s apart, at
# most 60 rounds and 20 s.
deadline=$((SECONDS + 20))
seen_rate=""
first=$(screen)
for round in $(seq 1 60); do
    cmds=()
    for i in $(seq 1 40); do cmds+=(-c "read $(( (RANDOM % 4096) * 4096 )) 4k"); done
    qemu-io -f raw "${cmds[@]}" "$URI" >/dev/null
    sleep 0.3
    now=$(screen)
    # The last interval's read hit ratio and a non-zero reads/s in the first column.
    if grep -Eq 'read hit ratio +100\.0%' <<<"$now" && grep -Eq 'reads/s +[1-9][0-9]*\.[0-9]' <<<"$now"; then
        seen_rate=yes
        break
    fi
    (( SECONDS < deadline )) || break
done
log "screen during the workload:"$'\n'"$now"
[[ -n "$seen_rate" ]] || fail "stats --watch never showed a read rate and a 100% hit ratio"
assert_contains "$now" "5 min" "the 5-minute column"
assert_contains "$now" "1 hour" "the 1-hour column"
assert_contains "$now" "volume vol0" "the volume"
# Redrawn in place: one header on the screen, and it changes between captures.
assert_eq "$(grep -c '^cache ' <<<"$now")" 1 "headers on the screen (redrawn in place, not scrolled)"
[[ "$now" != "$first" ]] || fail "the screen did not change"
sleep 1.2
later=$(screen)
[[ "$later" != "$now" ]] || fail "the screen did not update after 1.2 s"

# The daemon stops: the watch exits 1 and says why.
stop_server
for i in $(seq 1 20); do
    grep -q "watch exited" <<<"$(screen)" && break
    sleep 0.5
done
end=$(screen)
cleanup_tmux
assert_contains "$end" "watch exited 1" "exit status after the daemon stopped"
assert_contains "$end" "no daemon answers" "the message after the daemon stopped"
