#!/usr/bin/env bash
# Control sockets and their link in the runtime directory across kill -9 and restarts (issue
# #10, item 7). With --control PATH, serve links the default path (RUNTIME/CACHE-UUID.ctl, where
# `stats --cache` looks) to PATH. After a kill -9 the stale sockets and the link are replaced
# by the next start (also when it uses the same --control, whose link then points at the new
# live socket); a clean stop leaves no socket and no dangling link; a socket or link some live
# daemon answers on is refused, and that daemon is not disturbed.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq truncate timeout
require_bin
if [[ $(id -u) -eq 0 ]]; then
    RUNTIME=/run/ssdcache
else
    RUNTIME=${XDG_RUNTIME_DIR:-${TMPDIR:-/tmp}}/ssdcache
fi

mk_sparse backing.img 128M
mk_sparse cache.img 32M
create_cache cache.img backing.img --name vol0 --mode write-through
UUID=$(ssd info --cache cache.img --json | jq -r .uuid)
LINK="$RUNTIME/$UUID.ctl"
CTL="$TEST_DIR/ctl.sock"
NBD="$TEST_DIR/nbd.sock"

# assert_live WHAT: `stats --cache` reaches the daemon through the default path.
assert_live() {
    local source
    source=$(stats_json cache.img | jq -r .source)
    assert_eq "$source" live "$1: stats --cache"
}
# assert_link_to TARGET WHAT
assert_link_to() {
    [[ -L "$LINK" ]] || fail "$2: $LINK is not a link"
    assert_eq "$(readlink "$LINK")" "$(readlink -f "$1")" "$2: link target"
}
assert_gone() { # assert_gone WHAT PATH...
    local what=$1 p
    shift
    for p in "$@"; do
        [[ ! -e "$p" && ! -L "$p" ]] || fail "$what: $p is left behind"
    done
}

# ---- kill -9, then a restart with the same --control ----
start_server "$NBD" --cache cache.img --control "$CTL"
assert_link_to "$CTL" "first start"
assert_live "first start"
kill9_server
[[ -S "$CTL" && -L "$LINK" && -S "$NBD" ]] || fail "kill -9 should leave the sockets and the link"
KEEP_STALE_SOCKET=1 start_server "$NBD" --cache cache.img --control "$CTL"
assert_link_to "$CTL" "restart after kill -9 with the same --control"
assert_live "restart after kill -9 with the same --control"
stop_server
assert_gone "clean stop" "$LINK" "$CTL" "$NBD"
grep -q 'removing stale socket' "$SERVER_LOG" || fail "the stale sockets were not reported: $(cat "$SERVER_LOG")"
log "kill -9 then the same --control: link replaced; a clean stop leaves nothing behind"

# ---- kill -9, then a restart with another --control ----
start_server "$NBD" --cache cache.img --control "$CTL"
kill9_server
KEEP_STALE_SOCKET=1 start_server "$NBD" --cache cache.img --control "$TEST_DIR/ctl2.sock"
assert_link_to "$TEST_DIR/ctl2.sock" "restart with another --control"
assert_live "restart with another --control"
stop_server
assert_gone "clean stop" "$LINK" "$TEST_DIR/ctl2.sock" "$NBD"
rm -f "$CTL" # the first daemon's stale socket: no daemon owns it any more

# ---- kill -9 with the default control path (a socket, not a link) ----
start_server "$NBD" --cache cache.img
[[ -S "$LINK" && ! -L "$LINK" ]] || fail "the default control socket is missing"
kill9_server
KEEP_STALE_SOCKET=1 start_server "$NBD" --cache cache.img
assert_live "restart after kill -9 on the default control path"
stop_server
assert_gone "clean stop" "$LINK" "$NBD"
log "kill -9 with the default control path: stale socket replaced"

# ---- a live socket is refused, its daemon undisturbed ----
mk_sparse backing2.img 128M
mk_sparse cache2.img 32M
create_cache cache2.img backing2.img --name other --mode write-through
start_server "$NBD" --cache cache.img --control "$CTL"
expect_fail_stderr "a second daemon on the same NBD socket" 'in use by a running server' \
    "$SSDCACHE_BIN" serve --cache cache2.img --socket "$NBD"
expect_fail_stderr "a second daemon on the same control socket" 'in use by a running server' \
    "$SSDCACHE_BIN" serve --cache cache2.img --socket "$TEST_DIR/nbd2.sock" --control "$CTL"
assert_gone "refused start" "$TEST_DIR/nbd2.sock"
assert_server_alive
assert_link_to "$CTL" "after the refused starts"
assert_live "after the refused starts"
qio "$(nbd_uri "$NBD")" "write -P 7 0 65536" "read -P 7 0 65536" >/dev/null
stop_server
assert_gone "clean stop" "$LINK" "$CTL" "$NBD"
log "ok: stale sockets and links replaced after kill -9; none left after clean stops; live ones refused"
