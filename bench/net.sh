# bench/net.sh: section 6 of bench/run (sourced by it, not run on its own).
#
# The cache in front of a backing device reached over the network (issue 13 item 5): an NBD
# export served by nbdkit's file plugin with its delay filter adding a fixed latency to every
# read and write (1 ms and 5 ms; --quick 1 ms), the way a network hop to a distributed store
# adds it. For each latency, fio's nbd engine, 4 KiB requests at QD16 over a working set:
#   * random reads and random writes on the bare export (what a client there gets without a
#     cache);
#   * the same through ssdcache in write-back, whose backing device is that export
#     (`--backing nbd+unix:///?socket=...`): reads after one warming pass (hits), writes
#     absorbed by the cache (the cleaner destages them to the export meanwhile).
# Reported as IOPS and p99 latency side by side, and ssdcache's ratio to the bare export.
#
# Uses from bench/run: $BIN $T $RES $QUICK $HDD_RUNTIME, note_cmd_once, wait_socket, stop_pid,
# forget_pid, STARTED_PIDS, log, die. Results in $RES/net/: bare-{read,write}-DELAY.json,
# cached-{read,write}-DELAY.json (fio), env.json.

NRES="$RES/net"
mkdir -p "$NRES"
if [ "$QUICK" = 1 ]; then
    NET_DELAYS=(1ms) NET_WS_MIB=64 NET_RUNTIME=3
else
    NET_DELAYS=(1ms 5ms) NET_WS_MIB=256 NET_RUNTIME=$HDD_RUNTIME
fi
NET_BACKING="$T/net-backing.img" NET_CACHE="$T/net-cache.img"
NET_EXPORT_SOCK="$T/net-export.sock" NET_SOCK="$T/net-ssdcache.sock" NET_CTL="$T/net-ctl.sock"
NET_EXPORT_URI="nbd+unix:///?socket=$NET_EXPORT_SOCK"
NET_URI="nbd+unix:///net?socket=$NET_SOCK"
NET_FIO=(--bs=4k --iodepth=16 --offset=0 --size="${NET_WS_MIB}m" --time_based
         --runtime="$NET_RUNTIME" --ramp_time=1 --randrepeat=0 --norandommap
         --percentile_list=50:90:99:99.9)

# The backing export's data: the working set written once (holes would read as zeroes at no
# cost on the server, which is not what a store does).
rm -f "$NET_BACKING"
truncate -s 1G "$NET_BACKING"
fio --name=fill-net-backing --filename="$NET_BACKING" --rw=write --bs=1m --size="${NET_WS_MIB}m" \
    --ioengine=psync --output=/dev/null >/dev/null 2>&1 || die "could not write the network backing file"
rm -f "$NET_CACHE"
truncate -s 640M "$NET_CACHE"

NET_EXPORT_PID="" NET_PID=""
net_export_start() { # delay
    rm -f "$NET_EXPORT_SOCK"
    local args=(--unix "$NET_EXPORT_SOCK" --foreground --filter=delay file "$NET_BACKING"
                "rdelay=$1" "wdelay=$1")
    note_cmd_once nbdkit "${args[@]}"
    nbdkit "${args[@]}" >>"$T/nbdkit-net.log" 2>&1 &
    NET_EXPORT_PID=$!
    STARTED_PIDS+=("$NET_EXPORT_PID")
    wait_socket "$NET_EXPORT_PID" "$NET_EXPORT_SOCK" ||
        { tail -20 "$T/nbdkit-net.log" >&2; die "nbdkit (delay filter) did not start"; }
}
net_export_stop() { stop_pid "$NET_EXPORT_PID"; forget_pid "$NET_EXPORT_PID"; NET_EXPORT_PID=""; }
net_ssdcache_start() {
    # nbdkit's file plugin sends no export description: trusted by name (a benchmark).
    local create=(create --cache "$NET_CACHE" --backing "$NET_EXPORT_URI" --mode write-back
                  --sequential-cutoff 0 --name net --discard-dirty-data --trust-export-name)
    note_cmd_once "$BIN" "${create[@]}"
    "$BIN" "${create[@]}" >/dev/null || die "ssdcache create in front of the export failed"
    rm -f "$NET_SOCK"
    local args=(serve --cache "$NET_CACHE" --socket "$NET_SOCK" --control "$NET_CTL")
    note_cmd_once "$BIN" "${args[@]}"
    "$BIN" "${args[@]}" >>"$T/ssdcache-net.log" 2>&1 &
    NET_PID=$!
    STARTED_PIDS+=("$NET_PID")
    wait_socket "$NET_PID" "$NET_SOCK" || { tail -20 "$T/ssdcache-net.log" >&2; die "ssdcache serve (network backing) did not start"; }
}
net_ssdcache_stop() { stop_pid "$NET_PID"; forget_pid "$NET_PID"; NET_PID=""; }
net_fio() { # OUT.json URI fio-args...
    local out=$1 uri=$2; shift 2
    note_cmd_once fio --ioengine=nbd --uri=URI "${NET_FIO[@]}" "$@" --output-format=json --output=RESULT.json
    fio --ioengine=nbd --uri="$uri" "${NET_FIO[@]}" "$@" --output-format=json --output="$out" \
        >/dev/null 2>>"$NRES/fio.stderr" || die "fio failed (see $out)"
}

for delay in "${NET_DELAYS[@]}"; do
    log "network backing, $delay per request: bare export"
    net_export_start "$delay"
    net_fio "$NRES/bare-read-$delay.json" "$NET_EXPORT_URI" --name=bare-read --rw=randread
    net_fio "$NRES/bare-write-$delay.json" "$NET_EXPORT_URI" --name=bare-write --rw=randwrite
    log "network backing, $delay per request: ssdcache write-back in front of it"
    net_ssdcache_start
    # One pass over the working set in 1 MiB reads fills the cache (QD16 hides the delay).
    fio --name=warm --ioengine=nbd --uri="$NET_URI" --rw=read --bs=1m --iodepth=16 --offset=0 \
        --size="${NET_WS_MIB}m" --output=/dev/null >/dev/null 2>>"$NRES/fio.stderr" || die "warming failed"
    net_fio "$NRES/cached-read-$delay.json" "$NET_URI" --name=cached-read --rw=randread
    net_fio "$NRES/cached-write-$delay.json" "$NET_URI" --name=cached-write --rw=randwrite
    net_ssdcache_stop
    net_export_stop
done
python3 - "$NRES/env.json" <<EOF
import json, sys
json.dump({"delays": "${NET_DELAYS[*]}".split(), "working_set_mib": $NET_WS_MIB,
           "runtime": $NET_RUNTIME, "qd": 16, "bs": "4k"}, open(sys.argv[1], "w"))
EOF
rm -f "$NET_BACKING" "$NET_CACHE"
