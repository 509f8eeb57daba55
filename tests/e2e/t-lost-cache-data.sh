#!/usr/bin/env bash
# A cache file truncated and extended again while it held dirty data (the region past the cut
# now reads as zeroes): `detach` must not write those zeroes onto the backing device. It
# refuses, names the damaged ranges and changes neither file; `detach --discard-damaged`
# then writes back everything intact and leaves the damaged ranges' older backing data.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq md5sum python3
require_bin

mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name wb --mode write-back --sequential-cutoff 0
URI=$(nbd_uri "$TEST_DIR/wb.sock" wb)

# 48 MiB of dirty data: 96 pieces of 512 KiB, each its own byte pattern, spread over the disk.
start_server "$TEST_DIR/wb.sock" --cache cache.img --writeback-max-age 3600
cmds=()
for i in $(seq 0 95); do
    cmds+=("write -P $((i + 1)) $((i * 5))M 512k")
done
qio "$URI" "${cmds[@]}" "flush" >/dev/null
stop_server
dirty=$(ssd info --cache cache.img --json | jq '.volumes[0].dirty_bytes')
assert_eq "$dirty" $((48 << 20)) "dirty bytes before the damage"

# Cut the cache file inside its dirty data and extend it again: the tail reads as zeroes.
data_offset=$(ssd info --cache cache.img --json | jq '.data_offset')
truncate -s $((data_offset + (24 << 20))) cache.img
truncate -s 128M cache.img
before=$(md5sum <backing.img)

expect_fail_stderr "detach over a cache that lost part of its dirty data" \
    "fail their checksums.*bytes \[.*--discard-damaged" \
    "$SSDCACHE_BIN" detach --cache cache.img
assert_eq "$(md5sum <backing.img)" "$before" "the backing file after the refused detach"
assert_eq "$(ssd info --cache cache.img --json | jq '.volumes[0].dirty_bytes')" "$dirty" \
    "the dirty data is still in the cache"

out=$(ssd detach --cache cache.img --discard-damaged 2>&1) || fail "detach --discard-damaged: $out"
assert_contains "$out" "gave up" "detach says what it gave up"
given_up=$(grep -c "volume 'wb' bytes \[" <<<"$out" || true)
assert_gt "$given_up" 0 "ranges given up"
# Every 64 KiB line of every piece is either its pattern (written back) or zeroes (given up,
# the backing file's older data); there are some of each.
read -r intact lost < <(python3 - backing.img <<'PY'
import sys
intact = lost = 0
with open(sys.argv[1], "rb") as f:
    for i in range(96):
        for j in range(8):
            f.seek(i * 5 * 2**20 + j * 65536)
            chunk = f.read(65536)
            if chunk == bytes([i + 1]) * 65536:
                intact += 1
            elif chunk == bytes(65536):
                lost += 1
            else:
                sys.exit(f"piece {i} line {j}: neither its data nor the old zeroes")
print(intact, lost)
PY
) || fail "the backing file holds data that is neither written back nor the old contents"
assert_gt "$intact" 0 "lines written back"
assert_gt "$lost" 0 "lines given up"
log "detach refused the damaged cache, then wrote back $intact lines and gave up $lost"
