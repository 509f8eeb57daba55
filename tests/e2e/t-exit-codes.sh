#!/usr/bin/env bash
# Exit status of every command (`ssdcache --help`, docs/operations.md): 2 for bad usage (clap's
# own and ssdcache's checks of flags and values), 1 for errors (paths that cannot be opened,
# devices, states). Things a new user hit: `create --backing DIR`, `info` on things that are not
# caches (one clear line, no doubled message), `stats --control X --cache Y` with no daemon on X.
source "$(dirname "$0")/lib.sh"
require_tool python3 jq truncate
require_bin

mk_sparse backing.img 256M
mk_sparse other.img 256M
mk_sparse cache.img 64M
mk_sparse zeros.img 64M
create_cache cache.img backing.img --name vol --mode write-back
mkdir -p adir
CTL="$TEST_DIR/nobody.ctl"

# said_once: the error is one line, and no part of it is repeated right after itself (as in
# "failed to fill whole buffer: failed to fill whole buffer").
said_once() {
    local err
    err=$(grep 'ssdcache: error' "$TEST_DIR/es.err") || fail "no error line: $(cat "$TEST_DIR/es.err")"
    [[ $(wc -l <<<"$err") -eq 1 ]] || fail "more than one error line: $err"
    python3 - "$err" <<'PY' || fail "a doubled message: $err"
import sys
parts = sys.argv[1].split(": ")
sys.exit(any(a == b for a, b in zip(parts, parts[1:])))
PY
}

# ---- create ----
expect_status 2 "create --backing DIR" "backing device adir is a directory, not a regular file or a block device" \
    "$SSDCACHE_BIN" create --cache zeros.img --backing adir
expect_status 2 "create --cache DIR" "cache adir is a directory" \
    "$SSDCACHE_BIN" create --cache adir --backing backing.img
expect_status 2 "create with a bad volume name" "volume name.*--name" \
    "$SSDCACHE_BIN" create --cache zeros.img --backing backing.img --name 'a/b'
expect_status 2 "create with cache and backing the same" "same file or device" \
    "$SSDCACHE_BIN" create --cache backing.img --backing backing.img
expect_status 2 "create --line-size 3KiB (clap)" "line" \
    "$SSDCACHE_BIN" create --cache zeros.img --backing backing.img --line-size 3KiB
expect_status 1 "create on a missing cache path" "cannot open cache.*no such file" \
    "$SSDCACHE_BIN" create --cache "$TEST_DIR/none.img" --backing backing.img
expect_status 1 "create over a cache without --force" "already holds an ssdcache cache.*--force" \
    "$SSDCACHE_BIN" create --cache cache.img --backing backing.img

# ---- serve ----
expect_status 2 "serve --threads 0" "threads" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/s.sock" --threads 0
expect_status 2 "serve without a cache" "no cache given" \
    "$SSDCACHE_BIN" serve --socket "$TEST_DIR/s.sock"
expect_status 2 "serve --dirty-limit 120" "dirty-limit must be a percentage" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/s.sock" --dirty-limit 120
printf 'dirty_limit = -5\n' >dirty.toml
expect_status 2 "serve with dirty_limit = -5 in its config file" "dirty-limit must be a percentage" \
    "$SSDCACHE_BIN" serve --config dirty.toml --cache cache.img --socket "$TEST_DIR/s.sock"
expect_status 2 "serve --record-sample without --record-trace" "need --record-trace" \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/s.sock" --record-sample 0.5
printf 'cahce = "cache.img"\n' >typo.toml
expect_status 2 "serve with a typo in its config file" "config file.*not valid" \
    "$SSDCACHE_BIN" serve --config typo.toml --cache cache.img --socket "$TEST_DIR/s.sock"
printf '[volume.nope]\nadmission = "2-hit"\n' >novol.toml
expect_status 2 "serve with a config file naming no volume of the cache" "no volume named \"nope\"" \
    "$SSDCACHE_BIN" serve --config novol.toml --cache cache.img --socket "$TEST_DIR/s.sock"
expect_status 1 "serve a file that is not a cache" "is not an ssdcache cache" \
    "$SSDCACHE_BIN" serve --cache zeros.img --socket "$TEST_DIR/s.sock"

# ---- info: things that are not caches ----
truncate -s 0 empty.img
head -c $((1024 * 1024)) /dev/urandom >random.img
truncate -s 1000 odd.img
expect_status 2 "info --cache /dev/null" "^ssdcache: error: /dev/null is not an ssdcache cache \(a character device" \
    "$SSDCACHE_BIN" info --cache /dev/null
said_once
expect_status 2 "info --cache DIR" "adir is not an ssdcache cache \(a directory" \
    "$SSDCACHE_BIN" info --cache adir
said_once
for f in empty.img random.img odd.img; do
    size=$(stat -c %s "$f")
    expect_status 1 "info on $f" "$f is not an ssdcache cache \(too small: $size bytes" \
        "$SSDCACHE_BIN" info --cache "$f"
    said_once
done
expect_status 1 "info on a file of zeros" "zeros.img is not an ssdcache cache \(no superblock magic" \
    "$SSDCACHE_BIN" info --cache zeros.img
said_once
expect_status 1 "info on a missing file" "cannot open cache.*no such file" \
    "$SSDCACHE_BIN" info --cache "$TEST_DIR/none.img"
said_once
expect_status 2 "info without --cache (clap)" "required" "$SSDCACHE_BIN" info

# ---- stats ----
expect_status 2 "stats without --cache or --control (clap)" "required" "$SSDCACHE_BIN" stats
expect_status 1 "stats --control X --cache Y, nobody on X" "no daemon answers on control socket $CTL \(given with --control\)" \
    "$SSDCACHE_BIN" stats --control "$CTL" --cache cache.img
expect_status 1 "stats --control X, nobody on X" "no daemon answers on control socket $CTL" \
    "$SSDCACHE_BIN" stats --control "$CTL"
grep -q -- "give --cache" "$TEST_DIR/es.err" && fail "stats asks for --cache: $(cat "$TEST_DIR/es.err")"
stats=$(ssd stats --cache cache.img --json) || fail "offline stats failed: $stats"
assert_eq "$(jq -r .source <<<"$stats")" offline "stats source without a daemon"

# ---- flush, detach, recover, set-mode ----
expect_status 2 "flush --backing for an unknown volume" "no volume 'nope'.*its volumes: vol" \
    "$SSDCACHE_BIN" flush --cache cache.img --backing nope=backing.img
expect_status 1 "flush --control X, nobody on X" "no daemon answers on control socket $CTL" \
    "$SSDCACHE_BIN" flush --cache cache.img --control "$CTL"
expect_status 2 "detach --backing for an unknown volume" "no volume 'nope'" \
    "$SSDCACHE_BIN" detach --cache cache.img --backing nope=backing.img
expect_status 1 "detach a file that is not a cache" "is not an ssdcache cache" \
    "$SSDCACHE_BIN" detach --cache zeros.img
expect_status 2 "recover --volume unknown" "--volume nope: the cache has no volume 'nope'" \
    "$SSDCACHE_BIN" recover --cache cache.img --backing backing.img --volume nope
expect_status 1 "recover onto another device without --force" "not the backing device" \
    "$SSDCACHE_BIN" recover --cache cache.img --backing other.img
expect_status 2 "set-mode --volume unknown" "no volume 'nope'" \
    "$SSDCACHE_BIN" set-mode --cache cache.img --mode write-through --volume nope
expect_status 2 "set-mode --mode bogus (clap)" "invalid value" \
    "$SSDCACHE_BIN" set-mode --cache cache.img --mode bogus
expect_status 1 "set-mode on a file that is not a cache" "is not an ssdcache cache" \
    "$SSDCACHE_BIN" set-mode --cache zeros.img --mode write-through

# ---- hdd-emulator, simulate, advise, mrc ----
expect_status 2 "hdd-emulator --rpm 0" "HDD model parameters" \
    "$SSDCACHE_BIN" hdd-emulator --file backing.img --socket "$TEST_DIR/h.sock" --rpm 0
expect_status 1 "hdd-emulator on a missing file" "no such file" \
    "$SSDCACHE_BIN" hdd-emulator --file "$TEST_DIR/none.img" --socket "$TEST_DIR/h.sock"
expect_status 2 "simulate --cache-size 0 (clap)" "cache size must be above 0" \
    "$SSDCACHE_BIN" simulate --trace "$TEST_DIR/none.trace" --cache-size 0
expect_status 1 "simulate a missing trace" "none.trace" \
    "$SSDCACHE_BIN" simulate --trace "$TEST_DIR/none.trace" --cache-size 1GiB
expect_status 2 "simulate --writeback-low above --writeback-high" "must not be above --writeback-high" \
    "$SSDCACHE_BIN" simulate --trace "$TEST_DIR/none.trace" --mode write-back --writeback-high 30 --writeback-low 50
expect_status 2 "simulate --writeback-rate 0" "writeback-rate 0 would never" \
    "$SSDCACHE_BIN" simulate --trace "$TEST_DIR/none.trace" --mode write-back --writeback-rate 0
expect_status 2 "advise --target-hit-ratio 2 (clap)" "hit ratio" \
    "$SSDCACHE_BIN" advise --trace "$TEST_DIR/none.trace" --target-hit-ratio 2
expect_status 1 "advise on a missing trace" "none.trace" \
    "$SSDCACHE_BIN" advise --trace "$TEST_DIR/none.trace" --target-hit-ratio 0.9
expect_status 2 "mrc --json --csv -" "both write to standard output" \
    "$SSDCACHE_BIN" mrc --trace "$TEST_DIR/none.trace" --json --csv -
expect_status 1 "mrc on a missing trace" "none.trace" \
    "$SSDCACHE_BIN" mrc --trace "$TEST_DIR/none.trace"

# ---- the status is documented ----
help=$(ssd --help)
assert_contains "$help" "Exit status: 0 on success; 2 on bad usage" "ssdcache --help footer"
log "ok"
