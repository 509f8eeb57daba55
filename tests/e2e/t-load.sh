#!/usr/bin/env bash
# Load: 64 NBD connections × queue depth 32 of READ, WRITE (some FUA), TRIM, WRITE_ZEROES and
# FLUSH (4 KiB to 1 MiB) on a write-back volume whose cache is an eighth of the export (so
# eviction, dirty data and the cleaner all run), through `ssdcache-bench nbd-load`: every read
# is checked against a model of what each block may hold, then the whole export is read back
# twice. Then: the server's memory stayed within the bound of `serve --help` (--request-memory
# plus the per-connection and fixed parts below), nothing was logged at ERROR, a SIGTERM and a
# restart keep every block; a second load is cut by kill -9, and after the restart every block
# holds its last write acknowledged before a completed FLUSH (or FUA), or a later one, and
# reads the same after one more restart. Last, after `ssdcache detach` the backing file alone
# (served by nbdkit) reads the same, and a byte flipped in it is reported.
#
#   LOAD_SECONDS=25  LOAD_CONNECTIONS=64  LOAD_DEPTH=32  LOAD_SEED=<n> (to reproduce)
#   LOAD_EXPORT=1G  LOAD_CACHE=128M  LOAD_REQUEST_MEMORY_MIB=256
#   LOAD_MEMORY_PER_CONNECTION_KIB=4352  LOAD_MEMORY_FIXED_MIB=64   (the allowances of the bound)
#   SSDCACHE_BENCH_BIN (default: ssdcache-bench beside SSDCACHE_BIN)
source "$(dirname "$0")/lib.sh"
require_tool truncate timeout jq nbdinfo nbdkit dd
require_bin
BENCH_BIN=${SSDCACHE_BENCH_BIN:-$(dirname "$SSDCACHE_BIN")/ssdcache-bench}
[[ -x "$BENCH_BIN" ]] || fail "ssdcache-bench not found or not executable: $BENCH_BIN (cargo build --release -p ssdcache-bench, or set SSDCACHE_BENCH_BIN)"

LOAD_SECONDS=${LOAD_SECONDS:-25}
CONNECTIONS=${LOAD_CONNECTIONS:-64}
DEPTH=${LOAD_DEPTH:-32}
EXPORT_SIZE=${LOAD_EXPORT:-1G}
CACHE_SIZE=${LOAD_CACHE:-128M}
REQUEST_MEMORY_MIB=${LOAD_REQUEST_MEMORY_MIB:-256}
SEED=${LOAD_SEED:-$(( $(date +%s) % 1000000 ))}
MIB=$((1024 * 1024))
log "LOAD_SEED=$SEED: $CONNECTIONS connections × depth $DEPTH for ${LOAD_SECONDS}s, export $EXPORT_SIZE, cache $CACHE_SIZE"

# The memory bound is the one docs/design.md §6.1 documents: --request-memory bounds every
# request buffer (in use or kept); each connection adds a 256 KiB read-ahead buffer, and each
# of its worker threads its touched stack and, while its request misses, one cache line (the
# line read from the disk, its dirty sectors read into it in place; 64 KiB lines; 32 fast and up
# to 32 slow workers by default, either of which may miss: 4.25 MiB a connection in all); the
# cleaner holds at most 32
# merged writes of 4 MiB (128 MiB); the engine's commits and the allocator need a fixed amount
# on top of what the daemon holds at rest (allowed: 64 MiB).
help=$("$SSDCACHE_BIN" serve --help 2>&1) || fail "ssdcache serve --help failed: $help"
grep -q -- '--request-memory' <<<"$help" ||
    fail "serve --help documents no --request-memory: the NBD server has no memory bound to hold it to (issue #10 item 6)"
grep -q -- '--max-connections' <<<"$help" ||
    fail "serve --help documents no --max-connections (issue #10 item 6)"
request_memory_bytes=$((REQUEST_MEMORY_MIB * MIB))
PER_CONNECTION=$((${LOAD_MEMORY_PER_CONNECTION_KIB:-4352} * 1024))
CLEANER=$((128 * MIB))
FIXED=$((${LOAD_MEMORY_FIXED_MIB:-64} * MIB))

mk_sparse backing.img "$EXPORT_SIZE"
mk_sparse cache.img "$CACHE_SIZE"
create_cache cache.img backing.img --name load --mode write-back
sock="$TEST_DIR/nbd.sock"
SERVE_ARGS=(--cache cache.img --request-memory "${REQUEST_MEMORY_MIB}MiB" --max-connections $((CONNECTIONS + 8)))
start_server "$sock" "${SERVE_ARGS[@]}"

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }
sleep 1
baseline=$(( $(rss_kib "$SERVER_PID") * 1024 ))
bound=$((baseline + request_memory_bytes + CONNECTIONS * PER_CONNECTION + CLEANER + FIXED))
log "memory bound: $((baseline / MIB)) MiB at rest + $((request_memory_bytes / MIB)) MiB request memory + $CONNECTIONS × $((PER_CONNECTION / 1024)) KiB + $((CLEANER / MIB)) MiB cleaner + $((FIXED / MIB)) MiB = $((bound / MIB)) MiB"

# run_bench OUTFILE TIMEOUT ARGS...: bounded; fails the test with the output unless it ends "result: ok".
run_bench() {
    local out=$1 secs=$2 rc=0
    shift 2
    RUST_BACKTRACE=0 timeout -k 10 "$secs" "$BENCH_BIN" "$@" >"$out" 2>&1 || rc=$?
    [[ $rc -eq 0 ]] || fail "ssdcache-bench $1 failed (status $rc; LOAD_SEED=$SEED):
$(tail -n 60 "$out")"
    grep -q '^result: ok verify_errors=0 request_errors=0$' "$out" ||
        fail "ssdcache-bench $1 printed no clean result (LOAD_SEED=$SEED):
$(tail -n 60 "$out")"
}

# ---- 1. the load, checked as it runs, then read back twice ----
s0=$(stats_json cache.img)
run_bench load.out $((LOAD_SECONDS + 240)) nbd-load --socket "$sock" --connections "$CONNECTIONS" \
    --depth "$DEPTH" --seconds "$LOAD_SECONDS" --seed "$SEED" --verify --model-out model.a \
    --server-pid "$SERVER_PID" --server-memory-limit "$bound"
sed 's/^/    | /' load.out >&2
requests=$(grep -Eo '^load: [0-9]+ requests' load.out | grep -Eo '[0-9]+')
assert_gt "$requests" $((CONNECTIONS * DEPTH)) "requests completed by the load"
s1=$(stats_json cache.img)
delta() { echo $(( $(vol_field "$s1" load "$1") - $(vol_field "$s0" load "$1") )); }
log "stats after the load: $(jq -c '.volumes[0]' <<<"$s1")"
assert_gt "$(delta writes)" 0 "writes seen by the cache"
assert_gt "$(delta bytes_cleaned)" 0 "bytes the cleaner wrote back"
capacity=$(jq -r .capacity_bytes <<<"$s1")
assert_gt "$(delta bytes_to_cache)" "$capacity" "bytes written into the cache (more than it holds: lines were evicted and reused)"
assert_server_alive
if grep -E '\bERROR\b' "$SERVER_LOG" >/dev/null; then
    fail "the server logged errors under the load:
$(grep -E '\bERROR\b' "$SERVER_LOG" | head -n 20)"
fi

# ---- 2. SIGTERM, restart: every block as the read-back saw it ----
stop_server
start_server "$sock" "${SERVE_ARGS[@]}"
run_bench verify.b.out 300 nbd-verify --socket "$sock" --model-in model.a --model-out model.b
log "after SIGTERM and a restart: $(grep '^read-back:' verify.b.out | tr '\n' ' ')"

# ---- 3. kill -9 under the load: durable data survives ----
KILL_AFTER=$((5 + SEED % 6))
RUST_BACKTRACE=0 "$BENCH_BIN" nbd-load --socket "$sock" --connections "$CONNECTIONS" --depth "$DEPTH" \
    --seconds $((KILL_AFTER + 120)) --seed $((SEED + 1)) --model-in model.b --model-out model.c \
    --expect-kill >kill.out 2>&1 &
load_pid=$!
_PIDS+=("$load_pid")
sleep "$KILL_AFTER"
_is_ours_alive "$load_pid" || fail "the load ended before the kill -9:
$(tail -n 40 kill.out)"
kill9_server
_wait_gone "$load_pid" 120 || fail "the load did not end within 120 s of the kill -9:
$(tail -n 40 kill.out)"
rc=0
wait "$load_pid" || rc=$?
[[ $rc -eq 0 ]] || fail "the load cut by kill -9 failed (status $rc; LOAD_SEED=$SEED):
$(tail -n 60 kill.out)"
grep -q '^server went away (expected)' kill.out || fail "the load did not see the server die:
$(tail -n 40 kill.out)"
grep -q '^result: ok verify_errors=0 request_errors=0$' kill.out ||
    fail "the load cut by kill -9 found errors before the kill (LOAD_SEED=$SEED):
$(tail -n 60 kill.out)"
log "kill -9 after ${KILL_AFTER}s: $(grep -E '^load:' kill.out)"

export KEEP_STALE_SOCKET=1
start_server "$sock" "${SERVE_ARGS[@]}"
run_bench verify.d.out 300 nbd-verify --socket "$sock" --model-in model.c --model-out model.d
log "after kill -9 and a restart: $(grep '^read-back:' verify.d.out | tr '\n' ' ')"
stop_server
start_server "$sock" "${SERVE_ARGS[@]}"
run_bench verify.e.out 300 nbd-verify --socket "$sock" --model-in model.d
log "after one more restart: $(grep '^read-back:' verify.e.out | tr '\n' ' ')"
stop_server

# ---- 4. after detach the backing file alone holds it all; a planted error is caught ----
out=$(timeout -k 5 300 "$SSDCACHE_BIN" detach --cache cache.img 2>&1) || fail "ssdcache detach failed: $out"
file_sock="$TEST_DIR/file.sock"
nbdkit --foreground --unix "$file_sock" file file=backing.img >nbdkit.log 2>&1 &
_PIDS+=("$!")
for ((i = 0; i < 100; i++)); do [[ -S "$file_sock" ]] && break; sleep 0.1; done
[[ -S "$file_sock" ]] || fail "nbdkit did not come up: $(cat nbdkit.log)"
run_bench verify.f.out 300 nbd-verify --socket "$file_sock" --model-in model.d
log "the backing file alone after detach: $(grep '^read-back:' verify.f.out | tr '\n' ' ')"
block=$(awk 'NR > 4 && NF == 2 && $2 ~ /^[0-9]+$/ { print $1; exit }' model.d)
[[ -n "$block" ]] || fail "model.d names no block holding data"
printf '\xff' | dd of=backing.img bs=1 seek=$((block * 4096 + 1000)) conv=notrunc status=none
expect_fail_run out 300 env RUST_BACKTRACE=0 "$BENCH_BIN" nbd-verify --socket "$file_sock" --model-in model.d
grep -q "VERIFY ERROR: read-back: block $block .*damaged" <<<"$out" ||
    fail "a byte flipped in block $block was not reported: $(tail -n 20 <<<"$out")"
log "a byte flipped in block $block of the backing file is caught"
log "ok: LOAD_SEED=$SEED, $requests requests verified under load, memory within $((bound / MIB)) MiB, durable data kept across kill -9"
