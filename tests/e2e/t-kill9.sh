#!/usr/bin/env bash
# kill -9 of the daemon under a verifying NBD workload (nbd_verify.py), CYCLES times per mode.
# The workload writes self-identifying 4 KiB blocks (some FUA, a FLUSH about every 20 writes) and
# records durably what was sent and what was acknowledged as durable. After each kill -9 the
# daemon restarts and every block must hold its last durable write or a later one -- never older
# data, garbage, another block's data or data in a never-written place -- and read the same twice.
# What verify observed is recorded: a later crash must not bring back anything older either.
# At the end: a graceful stop and warm restart, another restart, and the backing file alone
# (write-through: directly; write-back: after `ssdcache detach`) must hold exactly that data.
#
#   MODES="write-back write-through" (default both)   CYCLES=20 (write-back)   CYCLES_WT=6
#   KILL9_SEED=<n> (to reproduce)
source "$(dirname "$0")/lib.sh"
require_tool python3 nbdinfo truncate timeout
require_bin
VERIFY="$E2E_DIR/nbd_verify.py"
[[ -r "$VERIFY" ]] || fail "missing $VERIFY"

MODES=${MODES:-"write-back write-through"}
CYCLES=${CYCLES:-20}
# Write-through never holds the only copy; a few cycles show that. Write-back gets all of them.
CYCLES_WT=${CYCLES_WT:-6}
BLOCKS=16384
SEED=${KILL9_SEED:-$(( $(date +%s) % 100000 ))}
RANDOM=$SEED
log "KILL9_SEED=$SEED MODES='$MODES' CYCLES=$CYCLES BLOCKS=$BLOCKS"

# run_verify MODE [verify args...]: bounded; fails the test with verify's output; prints its summary.
run_verify() {
    local mode=$1 out rc=0
    shift
    out=$(timeout -k 5 120 python3 "$VERIFY" verify "$@" 2>&1) || rc=$?
    [[ $rc -eq 0 ]] || fail "$mode: verify $* failed (status $rc):
$out"
    VERIFIED=$(grep -Eo '^verified [0-9]+ blocks' <<<"$out" | grep -Eo '[0-9]+') ||
        fail "$mode: verify printed no summary: $out"
    log "$mode: $out"
}

# ---- 0. the checker itself catches planted corruption (scratch volume, write-through) ----
mk_sparse st-backing.img 64M
mk_sparse st-cache.img 16M
create_cache st-cache.img st-backing.img --name st --mode write-through --sequential-cutoff 0
start_server "$TEST_DIR/selftest.sock" --cache st-cache.img
rc=0
out=$(timeout -k 5 120 python3 "$VERIFY" selftest "$SOCK" 2>&1) || rc=$?
[[ $rc -eq 0 ]] || fail "nbd_verify.py selftest (status $rc):
$out"
grep -q '^selftest passed' <<<"$out" || fail "nbd_verify.py selftest did not finish: $out"
log "verifier selftest: $(grep -c '^selftest ok' <<<"$out") checks passed (planted corruption is caught)"
stop_server

TOTAL_CYCLES=0
for MODE in $MODES; do
    mk_sparse "backing-$MODE.img" 256M
    mk_sparse "cache-$MODE.img" 64M
    create_cache "cache-$MODE.img" "backing-$MODE.img" --name vol0 --mode "$MODE" --sequential-cutoff 0
    state="$TEST_DIR/state-$MODE"
    sock="$TEST_DIR/$MODE.sock"
    unset KEEP_STALE_SOCKET
    start_server "$sock" --cache "cache-$MODE.img"
    export KEEP_STALE_SOCKET=1   # from now on every start follows a kill -9 (or a clean stop)
    writes_total=0
    cycles=$CYCLES
    [[ $MODE == write-back ]] || cycles=$CYCLES_WT
    for ((c = 1; c <= cycles; c++)); do
        ms=$((1000 + RANDOM % 3001))
        wout="$TEST_DIR/workload-$MODE.$c.out"
        python3 "$VERIFY" workload "$SOCK" "$state" --seed $((SEED * 100 + c)) --seconds 60 \
            --blocks "$BLOCKS" >"$wout" 2>&1 &
        wpid=$!
        _PIDS+=("$wpid")
        sleep "$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
        if ! _is_ours_alive "$wpid"; then
            rc=0
            wait "$wpid" || rc=$?
            fail "$MODE cycle $c: the workload exited (status $rc) before the kill -9:
$(cat "$wout")"
        fi
        kill9_server
        _wait_gone "$wpid" 60 || fail "$MODE cycle $c: the workload did not exit within 60s of the kill -9:
$(cat "$wout")"
        rc=0
        wait "$wpid" || rc=$?
        [[ $rc -eq 0 ]] || fail "$MODE cycle $c: workload exited with status $rc:
$(cat "$wout")"
        summary=$(grep '^workload:' "$wout") || fail "$MODE cycle $c: no workload summary: $(cat "$wout")"
        n=$(grep -Eo 'writes=[0-9]+' <<<"$summary" | cut -d= -f2)
        assert_gt "$n" 0 "$MODE cycle $c: writes acknowledged before the kill -9"
        grep -q 'server went away' <<<"$summary" ||
            fail "$MODE cycle $c: the workload did not see the server die: $summary"
        writes_total=$((writes_total + n))
        log "$MODE cycle $c: kill -9 after ${ms} ms; $summary"

        start_server "$sock" --cache "cache-$MODE.img"
        run_verify "$MODE cycle $c" "$SOCK" "$state"
        TOTAL_CYCLES=$((TOTAL_CYCLES + 1))
    done

    # Graceful stop, warm restart, verify; once more; then the backing file alone.
    stop_server
    start_server "$sock" --cache "cache-$MODE.img"
    run_verify "$MODE after a clean stop" "$SOCK" "$state"
    stop_server
    start_server "$sock" --cache "cache-$MODE.img"
    run_verify "$MODE after another restart" "$SOCK" "$state"
    stop_server
    if [[ $MODE == write-back ]]; then
        out=$(timeout -k 5 120 "$SSDCACHE_BIN" detach --cache "cache-$MODE.img" 2>&1) ||
            fail "$MODE: ssdcache detach failed: $out"
        log "$MODE: detach: $(tr '\n' ' ' <<<"$out" | head -c 300)"
    fi
    run_verify "$MODE backing file alone" - "$state" --file "backing-$MODE.img"
    log "$MODE: $cycles kill -9 cycles, $writes_total writes acknowledged, $VERIFIED blocks verified after each restart and in the backing file"
done
log "ok: $TOTAL_CYCLES kill -9 cycles in modes: $MODES"
