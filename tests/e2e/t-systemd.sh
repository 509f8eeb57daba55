#!/usr/bin/env bash
# Running as a service (issue 12, item 5): scripts/install puts the binary, its manual pages,
# its shell completions and the template unit ssdcache@.service under a prefix;
# `systemd-analyze verify` accepts the unit (with the man pages it names installed); bash
# completes the commands. Then the unit's own ExecStart runs the way systemd runs it
# (NOTIFY_SOCKET, SIGTERM): READY=1 comes only once the export serves (a client connects at
# once), STOPPING=1 and exit 0 on SIGTERM with the cache map written; after kill -9 the restart
# (Restart=on-failure) is READY again with every acknowledged write; a start that fails never
# says READY, and a settings mistake exits 2 (RestartPreventExitStatus=2: no restart loop).
source "$(dirname "$0")/lib.sh"
require_tool systemd-analyze man python3 nbdinfo qemu-io jq timeout bash
require_bin
LISTENER="$E2E_DIR/notify_listener.py"
[[ -r "$LISTENER" ]] || fail "missing $LISTENER"
M=$((1024 * 1024))

ROOT="$TEST_DIR/root"
P="$ROOT/usr" U="$ROOT/units" C="$ROOT/etc"
"$REPO/scripts/install" --bin "$SSDCACHE_BIN" --prefix "$P" --systemd-dir "$U" --config-dir "$C" \
    >install.log 2>&1 || fail "scripts/install failed: $(cat install.log)"
UNIT="$U/ssdcache@.service"
[[ -s "$UNIT" ]] || fail "no unit installed: $(cat install.log)"
# A path the unit cannot name is refused (exit 2) before anything is installed.
rc=0
"$REPO/scripts/install" --bin "$SSDCACHE_BIN" --prefix "$TEST_DIR/a b" --systemd-dir "$U" \
    --config-dir "$C" >badpath.log 2>&1 || rc=$?
assert_eq "$rc" 2 "install with a space in --prefix: $(cat badpath.log)"
[[ ! -e "$TEST_DIR/a b" ]] || fail "install with a bad --prefix installed something"

# ---- 1. the unit verifies; man pages and completions are there ----
MANPATH="$P/share/man" timeout 60 systemd-analyze verify "$UNIT" >verify.log 2>&1 \
    || fail "systemd-analyze verify failed: $(cat verify.log)"
[[ ! -s verify.log ]] || fail "systemd-analyze verify complained: $(cat verify.log)"
for c in "" -create -serve -stats -info -flush -detach -recover -set-mode -completions -man-pages; do
    [[ -s "$P/share/man/man1/ssdcache$c.1" ]] || fail "no manual page ssdcache$c.1: $(ls "$P/share/man/man1")"
done
page=$(MANPATH="$P/share/man" MANWIDTH=100 timeout 60 man ssdcache-serve 2>/dev/null)
assert_contains "$page" "shutdown-timeout" "man ssdcache-serve"
completed=$(bash -c 'source "$1"; COMP_WORDS=(ssdcache se); COMP_CWORD=1; COMP_LINE="ssdcache se"; COMP_POINT=${#COMP_LINE}; _ssdcache ssdcache se ssdcache; printf "%s\n" "${COMPREPLY[@]}"' _ \
    "$P/share/bash-completion/completions/ssdcache")
grep -qx serve <<<"$completed" || fail "bash does not complete 'ssdcache se' to serve: $completed"
grep -qx set-mode <<<"$completed" || fail "bash does not complete 'ssdcache se' to set-mode: $completed"
[[ -s "$P/share/zsh/site-functions/_ssdcache" && -s "$P/share/fish/vendor_completions.d/ssdcache.fish" ]] \
    || fail "zsh or fish completions missing"

# ---- 2. READY once serving, STOPPING and a clean exit on SIGTERM ----
mk_sparse backing.img 64M
mk_sparse cache.img 32M
create_cache cache.img backing.img --name vol0 --mode write-back --sequential-cutoff 0
cat >"$C/vol0.toml" <<CONF
cache = "$TEST_DIR/cache.img"
socket = "$TEST_DIR/vol0.sock"
control = "$TEST_DIR/vol0.ctl"
shutdown_timeout = 5
CONF
EXEC=$(sed -n 's/^ExecStart=//p' "$UNIT" | sed 's/%i/vol0/g')
[[ "$EXEC" == "$P/bin/ssdcache serve --config $C/vol0.toml" ]] || fail "unexpected ExecStart: $EXEC"
URI=$(nbd_uri "$TEST_DIR/vol0.sock" vol0)

N=0
# run_as_systemd: starts the unit's command with a notify socket; sets SVC_PID, NOTES, SVC_LOG.
run_as_systemd() {
    N=$((N + 1))
    NOTES="$TEST_DIR/notify.$N" SVC_LOG="$TEST_DIR/service.$N.log"
    python3 "$LISTENER" "$TEST_DIR/notify.sock.$N" "$NOTES" 120 &
    _PIDS+=("$!")
    local i
    for ((i = 0; i < 100; i++)); do grep -qs LISTENING "$NOTES" && break; sleep 0.1; done
    grep -qs LISTENING "$NOTES" || fail "the notify listener did not start"
    # As systemd does: the command line split on spaces, NOTIFY_SOCKET in the environment.
    # shellcheck disable=SC2086
    NOTIFY_SOCKET="$TEST_DIR/notify.sock.$N" $EXEC >"$SVC_LOG" 2>&1 &
    SVC_PID=$!
    _PIDS+=("$SVC_PID")
    _LOG_OF[$SVC_PID]=$SVC_LOG
}
# wait_note TEXT: waits (bounded, 30 s) for a notification containing TEXT.
wait_note() {
    local i
    for ((i = 0; i < 300; i++)); do
        grep -qF -- "$1" "$NOTES" && return 0
        _is_ours_alive "$SVC_PID" || fail "the service exited before '$1'; notes: $(cat "$NOTES"); log: $(cat "$SVC_LOG")"
        sleep 0.1
    done
    fail "no '$1' notification in 30 s; notes: $(cat "$NOTES"); log: $(cat "$SVC_LOG")"
}
# exited_with STATUS: waits (bounded) for the service to exit and checks its status; then
# gives the listener a moment to record what was sent before the exit.
exited_with() {
    _wait_gone "$SVC_PID" 60 || fail "the service did not exit; log: $(cat "$SVC_LOG")"
    local rc=0
    wait "$SVC_PID" || rc=$?
    assert_eq "$rc" "$1" "exit status; log: $(cat "$SVC_LOG")"
    check_no_panic "$SVC_PID"
    sleep 1
}

run_as_systemd
wait_note "READY=1"
# READY means serving: the cache is open and its export set up when READY is sent (the log
# says so before), and a client gets the export without retrying.
grep -q "serving volume 'vol0'" "$SVC_LOG" || fail "READY=1 before the export was set up: $(cat "$SVC_LOG")"
grep -Eq "cache (warm|starts cold)" "$SVC_LOG" || fail "READY=1 before the cache was open: $(cat "$SVC_LOG")"
size=$(timeout 10 nbdinfo --size "$URI") || fail "READY=1 was sent but the export does not answer"
assert_eq "$size" $((64 * M)) "export size at READY"
grep -F "READY=1" "$NOTES" | grep -qF "STATUS=serving 'vol0' (write-back)" \
    || fail "READY without the serving status: $(cat "$NOTES")"
grep -qF "STATUS=opening the cache (clean stop" "$NOTES" || fail "no status while opening: $(cat "$NOTES")"
# A volume added and removed while serving: `systemctl status` follows.
mk_sparse extra.img 16M
ssd volume add --cache cache.img --backing extra.img --name extra --mode write-through \
    --control "$TEST_DIR/vol0.ctl" >/dev/null || fail "volume add while serving"
wait_note "STATUS=serving 'vol0' (write-back), 'extra' (write-through)"
ssd volume remove --cache cache.img --name extra --control "$TEST_DIR/vol0.ctl" >/dev/null 2>&1 \
    || fail "volume remove while serving"
for ((i = 0; i < 50; i++)); do
    [[ "$(tail -n 1 "$NOTES")" == "STATUS=serving 'vol0' (write-back)" ]] && break
    sleep 0.1
done
assert_eq "$(tail -n 1 "$NOTES")" "STATUS=serving 'vol0' (write-back)" "the status after the removal"
qio "$URI" "write -P 0x5a 0 $((4 * M))" "flush" >/dev/null
kill -TERM "$SVC_PID"
exited_with 0
grep -qF "STOPPING=1" "$NOTES" || fail "no STOPPING=1 on SIGTERM: $(cat "$NOTES")"
grep -q "stopped cleanly" "$SVC_LOG" || fail "SIGTERM did not stop cleanly: $(cat "$SVC_LOG")"

# ---- 3. kill -9, then the restart systemd would make: READY again, nothing lost ----
run_as_systemd
wait_note "READY=1"
grep -q "cache warm" "$SVC_LOG" || fail "the start after a clean stop was not warm: $(cat "$SVC_LOG")"
qio "$URI" "write -P 0x6b $((4 * M)) $((4 * M))" "flush" >/dev/null
kill -KILL "$SVC_PID"
exited_with 137
run_as_systemd
wait_note "READY=1"
grep -qF "STATUS=opening the cache (no clean stop: replaying the journal)" "$NOTES" \
    || fail "no replay status after kill -9: $(cat "$NOTES")"
qio "$URI" "read -P 0x5a 0 $((4 * M))" "read -P 0x6b $((4 * M)) $((4 * M))" >/dev/null
kill -TERM "$SVC_PID"
exited_with 0

# ---- 4. a failed start never says READY; a settings mistake exits 2 ----
mv cache.img cache.moved
run_as_systemd
exited_with 1
grep -qF "READY=1" "$NOTES" && fail "READY=1 from a start that failed: $(cat "$NOTES")"
mv cache.moved cache.img
echo 'shutdown_timeuot = 5' >>"$C/vol0.toml"
run_as_systemd
exited_with 2
grep -qF "READY=1" "$NOTES" && fail "READY=1 from a start with bad settings: $(cat "$NOTES")"
grep -q "shutdown_timeuot" "$SVC_LOG" || fail "the bad key is not named: $(cat "$SVC_LOG")"
log "t-systemd: install, verify, man, completions, READY/STOPPING, kill -9 restart, failed starts: ok"
