#!/usr/bin/env bash
# One damaged superblock copy (A, then B) is reported by info (a WARNING line, and
# superblock_warning in --json) and by serve's log, the cache is served from the other copy,
# and serve rewrites the damaged copy when it opens the cache: afterwards info has nothing to
# warn about and the two copies are equal.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq cmp dd
require_bin

mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name wb --mode write-back --sequential-cutoff 0
start_server "$TEST_DIR/wb.sock" --cache cache.img --writeback-max-age 3600
qio "$(nbd_uri "$SOCK" wb)" "write -P 0x11 0 8M" "flush" >/dev/null
stop_server
assert_eq "$(ssd info --cache cache.img --json | jq -r .superblock_warning)" null "superblock_warning of a sound cache"

for copy in A B; do
    cp --sparse=always cache.img one.img
    offset=0
    [[ $copy == B ]] && offset=65536
    printf 'XXXX' | dd of=one.img bs=1 seek=$((offset + 100)) conv=notrunc status=none
    info=$(ssd info --cache one.img)
    grep -Eq "^WARNING .*superblock copy $copy \(byte $offset\) is damaged \(checksum mismatch\).*rewritten" <<<"$info" ||
        fail "info does not warn about copy $copy: $info"
    warning=$(ssd info --cache one.img --json | jq -r .superblock_warning)
    assert_contains "$warning" "copy $copy (byte $offset) is damaged" "info --json superblock_warning"
    start_server "$TEST_DIR/one.sock" --cache one.img --writeback-max-age 3600
    grep -Eq "WARN.*superblock copy $copy .*damaged" "$SERVER_LOG" ||
        fail "serve did not warn about copy $copy: $(cat "$SERVER_LOG")"
    grep -Eq "superblock copy $copy .*rewritten" "$SERVER_LOG" ||
        fail "serve did not rewrite copy $copy: $(cat "$SERVER_LOG")"
    qio "$(nbd_uri "$SOCK" wb)" "read -P 0x11 0 8M" >/dev/null
    stop_server
    assert_eq "$(ssd info --cache one.img --json | jq -r .superblock_warning)" null "superblock_warning after serve"
    info=$(ssd info --cache one.img)
    grep -q WARNING <<<"$info" && fail "info still warns after serve rewrote copy $copy: $info"
    cmp -s <(head -c 65536 one.img) <(tail -c +65537 one.img | head -c 65536) ||
        fail "the two superblock copies differ after a clean stop"
    log "copy $copy damaged: warned, served from the other copy, rewritten"
done
log "ok"
