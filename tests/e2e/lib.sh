# Shared helpers for the ssdcache end-to-end tests.  Sourced by every t-*.sh.
#
# Conventions:
#   * Every test runs in its own TEST_DIR (set by ./run, or made here when a test is run alone).
#   * Any failing command fails the test (set -eE + ERR trap prints the line).
#   * `fail MSG` fails the test explicitly; `require_tool` FAILS (never skips) when a tool is missing.
#   * Only PIDs this test started are ever signalled; only mounts/loops/fuse mounts it made are undone.
#   * Every wait loop is bounded in iterations and time.

set -eE -o pipefail
shopt -s nullglob inherit_errexit

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$E2E_DIR/../.." && pwd)"
SSDCACHE_BIN="${SSDCACHE_BIN:-$REPO/target/release/ssdcache}"
if [[ -z "${TEST_DIR:-}" ]]; then
    TEST_DIR="$(mktemp -d /tmp/ssdcache-e2e.XXXXXX)"
    _OWN_TEST_DIR=1
fi
cd "$TEST_DIR"

# Timeouts (seconds).
SERVER_START_TIMEOUT="${SERVER_START_TIMEOUT:-30}"
SERVER_STOP_TIMEOUT="${SERVER_STOP_TIMEOUT:-60}"

_PIDS=()        # every background process this test started
_MOUNTS=()      # filesystem mount points this test mounted
_LOOPS=()       # loop devices this test attached
_FUSES=()       # nbdfuse mount dirs this test set up
_SERVE_N=0
declare -A _LOG_OF     # server pid -> its log file
SERVER_PID=""
SERVER_LOG=""
SOCK=""

log()  { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

_on_err() {
    local rc=$? line=${BASH_LINENO[0]} src=${BASH_SOURCE[1]:-?}
    printf 'FAIL: command exited %d at %s:%s: %s\n' "$rc" "$(basename "$src")" "$line" "$BASH_COMMAND" >&2
}
trap _on_err ERR

_is_ours_alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }

# Waits (bounded) for PID to exit; returns 0 if it exited, 1 on timeout.
_wait_gone() {
    local pid=$1 secs=$2 i
    for ((i = 0; i < secs * 10; i++)); do
        _is_ours_alive "$pid" || return 0
        sleep 0.1
    done
    return 1
}

cleanup() {
    local rc=$? m l f p
    trap - ERR
    set +e
    for ((i = ${#_MOUNTS[@]} - 1; i >= 0; i--)); do
        m=${_MOUNTS[i]}
        mountpoint -q "$m" 2>/dev/null && { umount "$m" 2>/dev/null || umount -l "$m"; }
    done
    for ((i = ${#_LOOPS[@]} - 1; i >= 0; i--)); do
        l=${_LOOPS[i]}
        losetup "$l" >/dev/null 2>&1 && losetup -d "$l"
    done
    for ((i = ${#_FUSES[@]} - 1; i >= 0; i--)); do
        f=${_FUSES[i]}
        mountpoint -q "$f" 2>/dev/null && { fusermount3 -u "$f" 2>/dev/null || fusermount3 -uz "$f"; }
    done
    for p in "${_PIDS[@]}"; do
        _is_ours_alive "$p" && kill -TERM "$p" 2>/dev/null
    done
    for p in "${_PIDS[@]}"; do
        _wait_gone "$p" 10 || kill -KILL "$p" 2>/dev/null
    done
    wait 2>/dev/null
    if [[ -n "${_OWN_TEST_DIR:-}" && -z "${E2E_KEEP:-}" ]]; then
        cd /
        rm -rf "$TEST_DIR"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

require_tool() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null 2>&1 || fail "required tool '$t' is not installed"
    done
}

require_bin() {
    [[ -x "$SSDCACHE_BIN" ]] || fail "ssdcache binary not found or not executable: $SSDCACHE_BIN (set SSDCACHE_BIN)"
}

# mk_sparse PATH SIZE  (SIZE in truncate syntax, e.g. 512M)
mk_sparse() {
    rm -f "$1"
    truncate -s "$2" "$1"
}

ssd() { "$SSDCACHE_BIN" "$@"; }

nbd_uri() { # nbd_uri SOCK [EXPORT]
    printf 'nbd+unix:///%s?socket=%s' "${2:-}" "$1"
}

# create_cache CACHE BACKING [extra create args...]; fails the test with stderr if create fails.
create_cache() {
    local cache=$1 backing=$2
    shift 2
    local out
    if ! out=$(ssd create --cache "$cache" --backing "$backing" "$@" 2>&1); then
        fail "ssdcache create --cache $cache --backing $backing $* failed: $out"
    fi
}

# start_server SOCK [serve args...]
# Starts `ssdcache serve --socket SOCK args...` in the background; sets SERVER_PID, SERVER_LOG, SOCK.
# Waits (bounded) until the socket exists; fails with the daemon log if it exits or times out.
# With KEEP_STALE_SOCKET=1 a leftover socket file (e.g. after kill -9) is left in place and
# readiness is "an NBD client can connect" instead.
start_server() {
    local sock=$1
    shift
    _SERVE_N=$((_SERVE_N + 1))
    SERVER_LOG="$TEST_DIR/serve.$_SERVE_N.log"
    [[ -n "${KEEP_STALE_SOCKET:-}" ]] || rm -f "$sock"
    log "serve #$_SERVE_N: $SSDCACHE_BIN serve --socket $sock $*"
    "$SSDCACHE_BIN" serve --socket "$sock" "$@" >"$SERVER_LOG" 2>&1 &
    SERVER_PID=$!
    _PIDS+=("$SERVER_PID")
    _LOG_OF[$SERVER_PID]=$SERVER_LOG
    SOCK=$sock
    local i
    for ((i = 0; i < SERVER_START_TIMEOUT * 10; i++)); do
        # Ready once it accepts: serve binds its sockets before it opens the cache, so the
        # socket file alone does not mean the cache is open (its log says so first).
        if [[ -n "${KEEP_STALE_SOCKET:-}" ]]; then
            timeout 5 nbdinfo --size "$(nbd_uri "$sock")" >/dev/null 2>&1 && return 0
        elif [[ -S "$sock" ]] && grep -q "accepting connections" "$SERVER_LOG"; then
            return 0
        fi
        if ! _is_ours_alive "$SERVER_PID"; then
            local rc=0
            wait "$SERVER_PID" || rc=$?
            fail "server exited (status $rc) before its socket appeared; log:
$(cat "$SERVER_LOG")"
        fi
        sleep 0.1
    done
    fail "server socket $sock did not appear within ${SERVER_START_TIMEOUT}s; log:
$(cat "$SERVER_LOG")"
}

# stop_server [PID] [SIGNAL]: SIGTERM (or SIGNAL, e.g. INT), bounded wait, the daemon must exit
# with status 0.
stop_server() {
    local pid=${1:-$SERVER_PID} sig=${2:-TERM} rc=0
    [[ -n "$pid" ]] || fail "stop_server: no server pid"
    _is_ours_alive "$pid" || { wait "$pid" || rc=$?; fail "server $pid already dead (status $rc) before SIGTERM; log:
$(cat "$SERVER_LOG")"; }
    kill -"$sig" "$pid"
    if ! _wait_gone "$pid" "$SERVER_STOP_TIMEOUT"; then
        kill -KILL "$pid" 2>/dev/null || true
        fail "server $pid did not exit within ${SERVER_STOP_TIMEOUT}s of SIG$sig; log:
$(cat "$SERVER_LOG")"
    fi
    wait "$pid" || rc=$?
    [[ $rc -eq 0 ]] || fail "server exited with status $rc after SIG$sig (expected 0); log:
$(cat "$SERVER_LOG")"
    check_no_panic "$pid"
    log "server $pid stopped cleanly (SIG$sig)"
}

# check_no_panic PID: a server must never panic (not even in one connection's thread).
check_no_panic() {
    local l=${_LOG_OF[$1]:-}
    [[ -n "$l" && -e "$l" ]] || return 0
    if grep -q 'panicked' "$l"; then
        fail "server $1 panicked; log:
$(grep -B2 -A8 panicked "$l" | head -n 40)"
    fi
    return 0
}

# kill9_server [PID]: SIGKILL and reap.
kill9_server() {
    local pid=${1:-$SERVER_PID}
    _is_ours_alive "$pid" || fail "kill9_server: server $pid is not running"
    kill -KILL "$pid"
    _wait_gone "$pid" 10 || fail "server $pid survived SIGKILL"
    wait "$pid" 2>/dev/null || true
    check_no_panic "$pid"
    log "server $pid killed with SIGKILL"
}

assert_server_alive() {
    local pid=${1:-$SERVER_PID}
    _is_ours_alive "$pid" || fail "server $pid died; log:
$(cat "$SERVER_LOG")"
}

# expect_fail_run OUTVAR TIMEOUT CMD...: runs CMD (bounded), requires a non-zero exit that is not a
# timeout, stores combined stdout+stderr in OUTVAR.
expect_fail_run() {
    local __var=$1 __secs=$2 __rc=0 __out
    shift 2
    __out=$(timeout -k 5 "$__secs" "$@" 2>&1) || __rc=$?
    printf -v "$__var" '%s' "$__out"
    [[ $__rc -ne 0 ]] || fail "expected failure but succeeded: $*
output: $__out"
    [[ $__rc -ne 124 && $__rc -ne 137 ]] || fail "command timed out (${__secs}s) instead of failing: $*
output: $__out"
    log "failed as expected (status $__rc): $*"
}

# expect_fail_stderr DESC REGEX CMD...: non-zero exit, bounded, and a non-empty stderr matching REGEX (case-insensitive).
expect_fail_stderr() {
    local desc=$1 re=$2 rc=0
    shift 2
    timeout -k 5 30 "$@" >"$TEST_DIR/efs.out" 2>"$TEST_DIR/efs.err" || rc=$?
    local err
    err=$(cat "$TEST_DIR/efs.err")
    [[ $rc -ne 0 ]] || fail "$desc: expected non-zero exit, got 0: $*
stdout: $(cat "$TEST_DIR/efs.out")
stderr: $err"
    [[ $rc -ne 124 && $rc -ne 137 ]] || fail "$desc: timed out: $*"
    [[ -n "$err" ]] || fail "$desc: exit $rc but nothing on stderr: $*"
    grep -Eqi -- "$re" <<<"$err" || fail "$desc: stderr does not match /$re/: $*
stderr: $err"
    log "$desc: refused as expected (status $rc): $(head -c 200 <<<"$err" | tr '\n' ' ')"
}

# expect_status STATUS DESC REGEX CMD...: CMD (bounded) exits with exactly STATUS and prints on
# stderr a message matching REGEX (case-insensitive); the stderr is left in $TEST_DIR/es.err.
expect_status() {
    local want=$1 desc=$2 re=$3 rc=0 err
    shift 3
    timeout -k 5 30 "$@" >"$TEST_DIR/es.out" 2>"$TEST_DIR/es.err" </dev/null || rc=$?
    err=$(cat "$TEST_DIR/es.err")
    [[ $rc -eq $want ]] || fail "$desc: expected exit status $want, got $rc: $*
stdout: $(head -c 2000 "$TEST_DIR/es.out")
stderr: $err"
    grep -Eqi -- "$re" <<<"$err" || fail "$desc: stderr does not match /$re/: $*
stderr: $err"
    log "$desc: status $rc as expected: $(head -c 200 <<<"$err" | tr '\n' ' ')"
}

assert_eq() { # assert_eq ACTUAL EXPECTED DESC
    [[ "$1" == "$2" ]] || fail "$3: expected '$2', got '$1'"
}
assert_gt() { # assert_gt ACTUAL MIN DESC  (integer ACTUAL > MIN)
    [[ "$1" =~ ^[0-9]+$ ]] || fail "$3: not an integer: '$1'"
    (($1 > $2)) || fail "$3: expected > $2, got $1"
}
assert_contains() { # assert_contains HAYSTACK NEEDLE DESC
    grep -Fq -- "$2" <<<"$1" || fail "$3: '$2' not found in: $1"
}

# A client that writes through an operation on other volumes (adding or removing one while
# serving): start_pattern_writer URI BASE starts, in the background on one connection, 100
# writes of 64 KiB at BASE + i * 64 KiB with pattern i + 1, 20 ms apart (about 2 s); sets
# WRITER_PID, output in writer.log.
start_pattern_writer() {
    local cmds=() i
    for i in $(seq 0 99); do
        cmds+=(-c "write -P $((i + 1)) $(($2 + i * 65536)) 64k" -c "sleep 20")
    done
    qemu-io -f raw "${cmds[@]}" "$1" >writer.log 2>&1 &
    WRITER_PID=$!
    _PIDS+=("$WRITER_PID")
}

# finish_pattern_writer WHILE: the writer must still have been running (the operation
# overlapped it), then end without an error.
finish_pattern_writer() {
    _is_ours_alive "$WRITER_PID" || fail "the writing client ended before the $1 did: the test did not overlap them"
    wait "$WRITER_PID" || fail "the writing client failed during the $1: $(tail -5 writer.log)"
    if grep -qi "error\|fail" writer.log; then
        fail "the writing client saw errors during the $1: $(grep -i 'error\|fail' writer.log | head -3)"
    fi
}

# check_pattern_writes URI BASE WHEN: every piece start_pattern_writer wrote reads back with
# its own pattern.
check_pattern_writes() {
    local cmds=() i
    for i in $(seq 0 99); do cmds+=(-c "read -P $((i + 1)) $(($2 + i * 65536)) 64k"); done
    qemu-io -f raw "${cmds[@]}" "$1" >check-writes.log 2>&1 ||
        fail "writes lost $3: $(grep -m3 -i 'mismatch\|error' check-writes.log)"
}

# qemu-io against the export; every command given as -c. Fails on any error line in the output,
# because qemu-io's exit status does not reflect failed commands in older versions.
qio() { # qio URI CMD...
    local uri=$1 args=() c out rc=0
    shift
    for c in "$@"; do args+=(-c "$c"); done
    out=$(timeout -k 5 120 qemu-io -f raw "${args[@]}" "$uri" 2>&1) || rc=$?
    if [[ $rc -ne 0 ]] || grep -Eqi 'fail|error|mismatch|pattern verification' <<<"$out"; then
        fail "qemu-io failed (status $rc) on $uri with ${*}:
$out"
    fi
    printf '%s\n' "$out"
}

# stats_json CACHE: `ssdcache stats --cache CACHE --json`, validated as JSON.
stats_json() {
    local out
    out=$(timeout -k 5 30 "$SSDCACHE_BIN" stats --cache "$1" --json) || fail "ssdcache stats --cache $1 --json failed: $out"
    jq -e . >/dev/null <<<"$out" || fail "stats --json did not print valid JSON: $out"
    printf '%s\n' "$out"
}

# vol_field JSON NAME FIELD: the field of the volume NAME (or the first volume if NAME is empty).
vol_field() {
    local v
    v=$(jq -r --arg n "$2" --arg f "$3" '
        (if $n == "" then .volumes[0] else (.volumes[] | select(.name == $n)) end) | .[$f] // "MISSING"' <<<"$1")
    [[ "$v" != MISSING && -n "$v" ]] || fail "stats field '$3' of volume '$2' missing in: $1"
    printf '%s' "$v"
}

# nbdfuse_attach MOUNTDIR URI: exposes the export as MOUNTDIR/nbd (bounded wait); sets FUSE_FILE.
nbdfuse_attach() {
    local dir=$1 uri=$2 i
    mkdir -p "$dir"
    rm -f "$TEST_DIR/nbdfuse.pid"
    nbdfuse -P "$TEST_DIR/nbdfuse.pid" "$dir/nbd" "$uri" >>"$TEST_DIR/nbdfuse.log" 2>&1 &
    local pid=$!
    _PIDS+=("$pid")
    _FUSES+=("$dir")
    for ((i = 0; i < 200; i++)); do
        [[ -s "$TEST_DIR/nbdfuse.pid" && -e "$dir/nbd" ]] && { FUSE_FILE="$dir/nbd"; FUSE_PID=$pid; return 0; }
        _is_ours_alive "$pid" || fail "nbdfuse exited; log: $(cat "$TEST_DIR/nbdfuse.log")"
        sleep 0.1
    done
    fail "nbdfuse did not come up within 20s; log: $(cat "$TEST_DIR/nbdfuse.log")"
}

nbdfuse_detach() {
    local dir=$1
    fusermount3 -u "$dir" || fail "fusermount3 -u $dir failed"
    if [[ -n "${FUSE_PID:-}" ]]; then
        _wait_gone "$FUSE_PID" 20 || fail "nbdfuse $FUSE_PID did not exit after unmount"
        wait "$FUSE_PID" 2>/dev/null || true
    fi
}

# loop_attach FILE: sets LOOP_DEV.
loop_attach() {
    LOOP_DEV=$(losetup --find --show "$1") || fail "losetup --find --show $1 failed"
    _LOOPS+=("$LOOP_DEV")
}
loop_detach() {
    losetup -d "$1" || fail "losetup -d $1 failed"
    local i
    for ((i = 0; i < 50; i++)); do
        losetup "$1" >/dev/null 2>&1 || return 0
        sleep 0.1
    done
    log "warning: $1 still attached after losetup -d (autoclear pending)"
}

do_mount() { # do_mount DEV DIR
    mkdir -p "$2"
    mount "$1" "$2" || fail "mount $1 $2 failed"
    _MOUNTS+=("$2")
}
do_umount() {
    umount "$1" || fail "umount $1 failed"
}

# ---- ext4 file trees (t-ext4, t-wb-ext4) ----
check_fsck() { # check_fsck DEV
    local out rc=0
    out=$(timeout -k 5 300 fsck.ext4 -fn "$1" 2>&1) || rc=$?
    [[ $rc -eq 0 ]] || fail "fsck.ext4 -fn $1: status $rc:
$out"
    log "fsck clean ($1)"
}

# make_tree DIR SEED: ~250 files in nested directories, sizes 0..64 KiB with every 25th 1..3 MiB.
make_tree() {
    local root=$1 seed=$2 i d size
    RANDOM=$seed
    for ((i = 0; i < 250; i++)); do
        d="$root/d$((i % 7))/s$((i % 5))/t$((i % 3))"
        mkdir -p "$d"
        if ((i % 25 == 0)); then
            size=$(( (1 + RANDOM % 3) * 1024 * 1024 + RANDOM ))
        else
            size=$(( (RANDOM * 2) % 65537 ))
        fi
        head -c "$size" /dev/urandom >"$d/f$i.bin"
    done
    : >"$root/empty"
    head -c 4096 /dev/urandom >"$root/page"
    ln -s d0/s0/t0/f0.bin "$root/link"
    ln "$root/page" "$root/page.hard"
}
checksum_tree() { # checksum_tree SUBDIR OUTFILE [MIN_FILES] (paths relative to the mount)
    (cd "$MNT" && find "$1" -type f -print0 | sort -z | xargs -0 sha256sum) >"$2"
    local n
    n=$(wc -l <"$2")
    assert_gt "$n" "${3:-200}" "files checksummed in $1"
}
verify_sums() { # verify_sums SUMFILE [ROOT]
    local out rc=0
    out=$(cd "${2:-$MNT}" && sha256sum --quiet -c "$1" 2>&1) || rc=$?
    [[ $rc -eq 0 ]] || fail "sha256sum -c $1 failed (status $rc):
$(head -n 40 <<<"$out")"
    log "all $(wc -l <"$1") checksums in $(basename "$1") match"
}

# ---- Traces. Every run checks the synthetic traces of bench/libcachesim/synthetic (written by
# the test, with libCacheSim's miss ratios in bench/libcachesim/synthetic.csv); the shared
# traces are checked too when SSDCACHE_TRACES names their folder (CI: shared/traces beside the
# checkout); then a missing trace fails the test.

# shared_traces_dir: the folder SSDCACHE_TRACES names (a relative path from the repository), or
# nothing when it is unset.
shared_traces_dir() {
    [[ -n "${SSDCACHE_TRACES:-}" ]] || return 0
    local dir=$SSDCACHE_TRACES
    [[ $dir == /* ]] || dir="$REPO/$dir"
    [[ -d "$dir" ]] || fail "SSDCACHE_TRACES=$SSDCACHE_TRACES is not a folder"
    printf '%s\n' "$dir"
}

# shared_trace DIR RELATIVE: the trace's path; fails the test when it is missing.
shared_trace() {
    [[ -f "$1/$2" ]] || fail "shared trace $1/$2 is missing (SSDCACHE_TRACES=$SSDCACHE_TRACES)"
    printf '%s\n' "$1/$2"
}

# synthetic_traces DIR: writes the synthetic traces into DIR.
synthetic_traces() {
    python3 "$REPO/bench/libcachesim/synthetic" traces "$1" || fail "bench/libcachesim/synthetic traces $1 failed"
}

# synthetic_reference FILE PERCENT: libCacheSim's miss ratios on the synthetic trace FILE at
# PERCENT of its unique 4 KiB blocks, from synthetic.csv, as
# "lines=N unique=N lru=M fifo=M clock=M arc=M s3fifo=M".
synthetic_reference() {
    python3 - "$REPO/bench/libcachesim/synthetic.csv" "synthetic/$1" "$2" <<'PY' || fail "no reference for $1 at $2% in synthetic.csv"
import csv, sys
path, trace, percent = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [r for r in csv.DictReader(open(path)) if r["trace"] == trace]
unique = int(rows[0]["unique_blocks"])
lines = max(1, unique * percent // 100)
misses = {r["policy"]: r["miss_ratio"] for r in rows if int(r["cache_blocks"]) == lines}
assert len(misses) == 5, misses
print(f"lines={lines} unique={unique} " + " ".join(f"{p}={m}" for p, m in misses.items()))
PY
}

# spec_get SPEC KEY: the value of KEY=VALUE in SPEC (a space-separated list).
spec_get() {
    local pair
    for pair in $1; do
        [[ ${pair%%=*} == "$2" ]] && { printf '%s\n' "${pair#*=}"; return 0; }
    done
    fail "no $2 in '$1'"
}

# make_certs DIR CA_NAME: a CA, a server certificate for localhost / 127.0.0.1, a client one.
make_certs() {
    local dir=$1 who usage
    mkdir -p "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
        -keyout "$dir/ca-key.pem" -out "$dir/ca-cert.pem" -subj "/CN=$2" 2>/dev/null ||
        fail "openssl could not make a CA"
    for who in server client; do
        usage=serverAuth
        [[ $who == client ]] && usage=clientAuth
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
            -keyout "$dir/$who-key.pem" -out "$dir/$who.csr" -subj "/CN=localhost" 2>/dev/null ||
            fail "openssl could not make a $who key"
        printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=%s\n' \
            "$usage" >"$dir/$who.ext"
        openssl x509 -req -in "$dir/$who.csr" -CA "$dir/ca-cert.pem" -CAkey "$dir/ca-key.pem" \
            -CAcreateserial -days 30 -out "$dir/$who-cert.pem" -extfile "$dir/$who.ext" 2>/dev/null ||
            fail "openssl could not sign the $who certificate"
    done
}
