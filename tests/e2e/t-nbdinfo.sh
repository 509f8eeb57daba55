#!/usr/bin/env bash
# nbdinfo sees the export with the right size, block sizes, flags, read-only state and name.
source "$(dirname "$0")/lib.sh"
require_tool nbdinfo jq truncate
require_bin

mk_sparse backing.img 512M
mk_sparse cache.img 128M
create_cache cache.img backing.img --name vol0 --mode write-through

check_export() { # check_export JSON READONLY
    local j=$1 ro=$2 e
    e=$(jq -c '.exports[0]' <<<"$j")
    [[ "$e" != null ]] || fail "no export in nbdinfo output: $j"
    assert_eq "$(jq -r '."export-size"' <<<"$e")" $((512 << 20)) "export size"
    local min pref max
    min=$(jq -r '.block_size_minimum // "none"' <<<"$e")
    pref=$(jq -r '.block_size_preferred // "none"' <<<"$e")
    max=$(jq -r '.block_size_maximum // "none"' <<<"$e")
    assert_eq "$min" 1 "block_size_minimum (byte-granular requests, issue 13)"
    [[ "$pref" =~ ^[0-9]+$ ]] || fail "block_size_preferred missing: $e"
    (( pref >= 4096 && (pref & (pref - 1)) == 0 )) || fail "block_size_preferred $pref not a power of two >= 4096"
    assert_eq "$max" $((32 << 20)) "block_size_maximum"
    local f
    for f in can_flush can_fua can_trim can_zero can_cache can_multi_conn; do
        if [[ $ro == true && $f =~ ^can_(fua|trim|zero)$ ]]; then
            continue # meaningless (and usually hidden) on a read-only export
        fi
        assert_eq "$(jq -r ".$f" <<<"$e")" true "$f"
    done
    assert_eq "$(jq -r '.is_read_only' <<<"$e")" "$ro" "is_read_only"
}

start_server "$TEST_DIR/nbd.sock" --cache cache.img
perm=$(stat -c %a "$SOCK")
assert_eq "$perm" 600 "socket mode"

j=$(timeout 30 nbdinfo --json "$(nbd_uri "$SOCK")")
log "nbdinfo --json: $(jq -c '.exports[0]' <<<"$j")"
check_export "$j" false

# The named export reaches the same volume.
j=$(timeout 30 nbdinfo --json "$(nbd_uri "$SOCK" vol0)")
check_export "$j" false
assert_eq "$(jq -r '.exports[0]."export-name"' <<<"$j")" vol0 "export name"

# Export listing shows the volume name.
j=$(timeout 30 nbdinfo --list --json "$(nbd_uri "$SOCK")")
names=$(jq -r '.exports[]."export-name"' <<<"$j")
log "exports listed: $(tr '\n' ' ' <<<"$names")"
grep -qx vol0 <<<"$names" || fail "nbdinfo --list does not show vol0: $j"
txt=$(timeout 30 nbdinfo --list "$(nbd_uri "$SOCK")")
assert_contains "$txt" 'export="vol0"' "nbdinfo --list text"

# An unknown export name is refused.
rc=0; out=$(timeout 30 nbdinfo --size "$(nbd_uri "$SOCK" no-such-volume)" 2>&1) || rc=$?
[[ $rc -ne 0 ]] || fail "unknown export name was accepted: $out"
assert_server_alive
stop_server

# Read-only.
start_server "$TEST_DIR/nbd.sock" --cache cache.img --read-only
j=$(timeout 30 nbdinfo --json "$(nbd_uri "$SOCK")")
log "nbdinfo --json (read-only): $(jq -c '.exports[0]' <<<"$j")"
check_export "$j" true
# A write through a read-only export fails.
if command -v qemu-io >/dev/null; then
    rc=0; out=$(timeout 30 qemu-io -f raw -c 'write -P 0x11 0 4k' "$(nbd_uri "$SOCK")" 2>&1) || rc=$?
    grep -Eqi 'fail|error|read-only|permission' <<<"$out" || [[ $rc -ne 0 ]] || fail "write to read-only export succeeded: $out"
    log "write on read-only export refused: $(head -c 200 <<<"$out")"
fi
out=$(timeout -k 5 60 python3 "$E2E_DIR/nbd_raw.py" "$SOCK" read-only 2>&1) || fail "raw NBD read-only checks: $out"
log "$out"
stop_server

# TCP on 127.0.0.1 (--listen), in addition to the Unix socket.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start_server "$TEST_DIR/nbd.sock" --cache cache.img --listen "127.0.0.1:$port"
ok=
for ((i = 0; i < 100; i++)); do # the TCP listener may come up just after the Unix socket
    if sz=$(timeout 10 nbdinfo --size "nbd://127.0.0.1:$port/" 2>/dev/null); then ok=1; break; fi
    sleep 0.1
done
[[ -n $ok ]] || fail "no NBD service on 127.0.0.1:$port (--listen)"
assert_eq "$sz" $((512 << 20)) "export size over TCP"
j=$(timeout 30 nbdinfo --json "nbd://127.0.0.1:$port/vol0")
check_export "$j" false
stop_server
log "ok"
