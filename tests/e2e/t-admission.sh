#!/usr/bin/env bash
# Admission: `create --admission 2-hit` shows in `info`; a line read once is served from the
# disk and not cached (counted as not admitted), its second miss caches it, and the next read is
# served from the cache. serve's config file sets admission and cutoff per volume (kept in the
# superblock afterwards) and refuses a volume name the cache does not have.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq truncate
require_bin
K=1024; M=$((1024 * 1024))

mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-through --admission 2-hit

info=$("$SSDCACHE_BIN" info --cache cache.img --json) || fail "info --json failed: $info"
assert_eq "$(jq -r '.volumes[0].admission' <<<"$info")" 2-hit "info --json admission (create --admission 2-hit)"
txt=$("$SSDCACHE_BIN" info --cache cache.img) || fail "info failed: $txt"
assert_contains "$txt" "admission 2-hit" "info (text)"
expect_fail_stderr "create --admission with an unknown name" 'N-hit' \
    "$SSDCACHE_BIN" create --cache cache.img --backing backing.img --force --admission sometimes

start_server "$TEST_DIR/nbd.sock" --cache cache.img
URI=$(nbd_uri "$SOCK")
declare -A B
snap() { local s f; s=$(stats_json cache.img); for f in read_hits read_misses bytes_to_cache bytes_from_cache bytes_from_backing bytes_not_admitted; do B[$f]=$(vol_field "$s" vol0 "$f"); done; }
delta() { local s; s=$(stats_json cache.img); echo $(( $(vol_field "$s" vol0 "$1") - B[$1] )); }

# One 64 KiB line at 16 MiB (aligned: a single request, far below the 4 MiB stream cutoff).
LINE_AT=$((16 * M))
snap
qio "$URI" "read -P 0 $LINE_AT $((64 * K))" >/dev/null
assert_eq "$(delta read_misses)" 1 "first read: a miss"
assert_eq "$(delta bytes_to_cache)" 0 "first read: nothing cached under 2-hit"
assert_eq "$(delta bytes_not_admitted)" $((64 * K)) "first read: counted as not admitted"
snap
qio "$URI" "read -P 0 $LINE_AT $((64 * K))" >/dev/null
assert_eq "$(delta read_misses)" 1 "second read: still a miss (the second miss admits)"
assert_eq "$(delta bytes_to_cache)" $((64 * K)) "second read: the line is cached"
assert_eq "$(delta bytes_not_admitted)" 0 "second read: admitted"
snap
qio "$URI" "read -P 0 $LINE_AT $((64 * K))" >/dev/null
assert_eq "$(delta read_hits)" 1 "third read: a hit"
assert_eq "$(delta bytes_from_cache)" $((64 * K)) "third read: served from the cache"
assert_eq "$(delta bytes_from_backing)" 0 "third read: the disk is not read"
stop_server

# The config file switches the volume to `always` and a 1 MiB cutoff; it stays after restart.
cat >tuned.toml <<EOF
cache = "$TEST_DIR/cache.img"
[volume.vol0]
admission = "always"
sequential_cutoff = "1MiB"
EOF
start_server "$TEST_DIR/nbd.sock" --config tuned.toml
grep -q "admission always (was 2-hit)" "$SERVER_LOG" || fail "serve did not log the admission change; log:
$(cat "$SERVER_LOG")"
info=$("$SSDCACHE_BIN" info --cache cache.img --json) || fail "info --json failed: $info"
assert_eq "$(jq -r '.volumes[0].admission' <<<"$info")" always "admission from the config file"
assert_eq "$(jq -r '.volumes[0].sequential_cutoff' <<<"$info")" $M "sequential cutoff from the config file"
snap
qio "$URI" "read -P 0 $((32 * M)) $((64 * K))" >/dev/null
assert_eq "$(delta bytes_to_cache)" $((64 * K)) "always: the first miss is cached"
stop_server
start_server "$TEST_DIR/nbd.sock" --cache cache.img
info=$("$SSDCACHE_BIN" info --cache cache.img --json) || fail "info --json failed: $info"
assert_eq "$(jq -r '.volumes[0].admission' <<<"$info")" always "admission kept in the superblock without the config"
stop_server

# A volume the cache does not have, and a policy per volume where the file says otherwise.
printf '[volume.nosuch]\nadmission = "2-hit"\n' >bad-volume.toml
expect_fail_stderr "config names an unknown volume" 'nosuch.*vol0' \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/bad.sock" --config bad-volume.toml
printf 'policy = "lru"\n[volume.vol0]\npolicy = "arc"\n' >bad-policy.toml
expect_fail_stderr "two different policies for one cache" 'one per cache' \
    "$SSDCACHE_BIN" serve --cache cache.img --socket "$TEST_DIR/bad.sock" --config bad-policy.toml
log "ok"
