# bench/wb.sh: section 3 of bench/run (sourced by it after hdd.sh, not run on its own).
#
# Write-back. Engine level (`ssdcache-bench`, no NBD), on the HDD model:
#   a. destage of a burst of scattered 4 KiB writes (random offsets over the whole 2 GiB
#      model disk) by the cleaner, against a naive destage (each write alone, in arrival
#      order; the model's time, simulated exactly, checked by replaying its first writes in
#      real time);
#   b. destage of dense 64 KiB writes covering one region (random order), against the
#      model's sequential rate there;
#   c. crash recovery: a cache full of dirty data, no shutdown, time to open it again.
# Over NBD with fio (`ssdcache serve --emulate-hdd`, write-back cache of 512 MiB over the
# 2 GiB backing file):
#   d. foreground latency of the zipf workload (section 2's mix) on a warm working set:
#      baseline (no dirty backlog), while the cleaner writes back an aged backlog at its own
#      pace (`--writeback-max-age 1`), and while `ssdcache flush` writes it back at full speed.
#
# Uses from bench/run: $BIN $BENCH_BIN $T $RES $BACKING $TMP_PARENT $QUICK $HDD_RUNTIME,
# run/note_cmd_once/note_once, discard_cache, wait_socket, stop_pid, forget_pid,
# STARTED_PIDS, log, die, now, PCT_LIST, ZIPF_ARGS.
#
# Results in $RES/wb/: destage-scattered.json, destage-dense.json, recovery.json
# (ssdcache-bench's output), lat-NAME.{fio,meta,warmup,backlog}.json, env.json.

WRES="$RES/wb"
mkdir -p "$WRES"
MIB=$((1 << 20)) GIB=$((1 << 30))
WB_BACKING_SIZE=$(stat -c %s "$BACKING")      # the same scale as the HDD section: 2 GiB
if [ "$QUICK" = 1 ]; then
    SCAT_BYTES=$((32 * MIB)) NAIVE_SAMPLE=100 DENSE_BYTES=$((64 * MIB)) REC_CACHE=$((1 * GIB)) NEED_GIB=3
else
    SCAT_BYTES=$((1 * GIB)) NAIVE_SAMPLE=500 DENSE_BYTES=$((512 * MIB)) REC_CACHE=$((10 * GIB)) NEED_GIB=25
fi
SCAT_CACHE=$((5 * GIB / 4))                   # 1.25 GiB of 4 KiB lines: each scattered write takes its own line
DENSE_CACHE=$((DENSE_BYTES + DENSE_BYTES / 4 + 64 * MIB))   # room for the burst and the metadata
# d. latency. 4 KiB lines: the backlog's scattered 4 KiB writes then take 128 MiB of the cache
# (a quarter, below the 50% high watermark), where 64 KiB lines would need a line per write.
# The working set is warmed completely (--quick: a 64 MiB set, so that its short cap suffices),
# so that the baseline's reads all hit and what changes is the cleaner.
WB_CACHE_MIB=512 WB_LINE=4096 WB_RAMP=1
if [ "$QUICK" = 1 ]; then WB_WS_MIB=64; else WB_WS_MIB=256; fi
WB_WARM_CAP=$((4 * HDD_RUNTIME))              # as hdd.sh's warm-up cap (256 MiB take ~14 s)
BACKLOG_OFFSET_MIB=1024 BACKLOG_REGION_MIB=1024 BACKLOG_MIB=128

free_gib() { df -Pk "$TMP_PARENT" | awk 'NR==2 {printf "%d", $4 / 1048576}'; }
check_space() {
    local f; f=$(free_gib)
    [ "$f" -ge "$NEED_GIB" ] || die "section 3 (write-back): the crash-recovery test fills a $((REC_CACHE / GIB)) GiB \
cache file, so it needs $NEED_GIB GiB free in $TMP_PARENT; only $f GiB are free. Free some space, or use --tmp DIR \
on a larger disk filesystem."
}
check_space   # before anything else: fail now, not after the long destage

echo "# section 3: write-back (ssdcache-bench prints JSON; engine level, HDD model in-process)" >>"$CMDLOG"
wb_bench() { # OUT.json SUBCOMMAND ARGS...
    local out=$1; shift
    note_cmd_once "$BENCH_BIN" "$@"
    "$BENCH_BIN" "$@" >"$out" 2>>"$WRES/bench.stderr" || { tail -5 "$WRES/bench.stderr" >&2; die "ssdcache-bench $1 failed"; }
}

# ---- a. scattered burst
log "write-back: destage of $((SCAT_BYTES / MIB)) MiB of scattered 4 KiB writes over the $((WB_BACKING_SIZE / MIB)) MiB model disk (ssdcache-bench; naive sample $NAIVE_SAMPLE writes in real time)"
wb_bench "$WRES/destage-scattered.json" destage --cache "$T/wb-destage-cache.img" --cache-size "$SCAT_CACHE" \
    --backing "$T/wb-destage-backing.img" --backing-size "$WB_BACKING_SIZE" --line-size 4096 --pattern scattered \
    --bytes "$SCAT_BYTES" --naive-sample "$NAIVE_SAMPLE"
rm -f "$T/wb-destage-cache.img" "$T/wb-destage-backing.img"
python3 - "$WRES/destage-scattered.json" <<'EOF' >&2
import json, sys
d = json.load(open(sys.argv[1]))
print(f"    destage {d['destage_secs']:.1f} s vs naive {d['naive_model_secs']:.1f} s (model): {d['speedup_vs_naive']:.2f}x; "
      f"{d['backing_writes']} backing writes for {d['burst_writes']} burst writes; naive sample "
      f"{d['naive_sample_real_secs']:.2f} s real vs {d['naive_sample_model_secs']:.2f} s model")
EOF

# ---- b. dense burst
log "write-back: destage of $((DENSE_BYTES / MIB)) MiB of dense 64 KiB writes"
wb_bench "$WRES/destage-dense.json" destage --cache "$T/wb-destage-cache.img" --cache-size "$DENSE_CACHE" \
    --backing "$T/wb-destage-backing.img" --backing-size "$WB_BACKING_SIZE" --line-size 65536 --pattern dense \
    --bytes "$DENSE_BYTES"
rm -f "$T/wb-destage-cache.img" "$T/wb-destage-backing.img"
python3 - "$WRES/destage-dense.json" <<'EOF' >&2
import json, sys
d = json.load(open(sys.argv[1]))
print(f"    destage {d['destage_secs']:.2f} s = {d['destage_bytes_per_sec'] / 1e6:.0f} MB/s, "
      f"{d['share_of_sequential'] * 100:.0f}% of the model's sequential rate ({d['model_seq_bytes_per_sec'] / 1e6:.0f} MB/s)")
EOF

# ---- c. crash recovery of a cache full of dirty data
check_space
log "write-back: crash recovery of a $((REC_CACHE / GIB)) GiB cache full of dirty data"
wb_bench "$WRES/recovery.json" recovery --cache "$T/wb-recovery-cache.img" --cache-size "$REC_CACHE" \
    --backing "$T/wb-recovery-backing.img"
rm -f "$T/wb-recovery-cache.img" "$T/wb-recovery-backing.img"
python3 - "$WRES/recovery.json" <<'EOF' >&2
import json, sys
d = json.load(open(sys.argv[1]))
print(f"    open {d['open_secs'] * 1000:.0f} ms (journal replay {d['replay_ms']} ms): {d['recovered_dirty_lines']} dirty lines, "
      f"{d['recovered_dirty_bytes'] / 2**20:.0f} MiB recovered (fill took {d['fill_secs']:.1f} s)")
EOF

# ---- d. foreground latency while the cleaner writes back (NBD, fio, HDD model)
echo "# section 3: foreground latency while the cleaner writes back (NBD, ssdcache serve --emulate-hdd)" >>"$CMDLOG"
WB_CACHE="$T/wb-cache.img" WB_SOCK="$T/wb.sock" WB_CTL="$T/wb.ctl"
WB_URI="nbd+unix:///?socket=$WB_SOCK"
note_once "# URI = ${WB_URI//"$T"/\$T}"
wb_info() { # -> "lines line_size data_offset"
    "$BIN" info --cache "$WB_CACHE" --json |
        python3 -c 'import json,sys; i=json.load(sys.stdin); print(i["lines"], i["line_size"], i["data_offset"])'
}
wb_create() {
    "$BIN" create --cache "$WB_CACHE" --backing "$BACKING" --mode write-back --line-size "$WB_LINE" --name wb --force \
        >/dev/null || die "ssdcache create (write-back, $WB_LINE-byte lines) failed"
}
# The cache file's size: 512 MiB of lines plus the metadata for that many 4 KiB lines (found
# by formatting a sparse file), then written in full like the other cache files.
WB_FILE=$(((WB_CACHE_MIB + 1) * MIB))
for _ in 1 2 3 4 5 6; do
    rm -f "$WB_CACHE"; truncate -s "$WB_FILE" "$WB_CACHE"
    wb_create
    read -r wb_lines wb_ls _ <<<"$(wb_info)"
    [ $((wb_lines * wb_ls)) -eq $((WB_CACHE_MIB * MIB)) ] && break
    WB_FILE=$((WB_FILE + WB_CACHE_MIB * MIB - wb_lines * wb_ls))   # grow (or shrink) by what is missing
done
[ $((wb_lines * wb_ls)) -eq $((WB_CACHE_MIB * MIB)) ] || die "could not size the write-back cache file to $WB_CACHE_MIB MiB of lines"
rm -f "$WB_CACHE"
run fio --name=fill-wb-cache --filename="$WB_CACHE" --rw=write --bs=1m --size="$WB_FILE" \
    --direct=1 --ioengine=libaio --iodepth=8 --output=/dev/null
WB_PID=""
wb_start() { # extra serve args...
    note_cmd_once "$BIN" create --cache "$WB_CACHE" --backing "$BACKING" --mode write-back --line-size "$WB_LINE" --name wb --force
    wb_create
    rm -f "$WB_SOCK"
    local args=(serve --cache "$WB_CACHE" --socket "$WB_SOCK" --control "$WB_CTL" --emulate-hdd "$@")
    note_cmd_once "$BIN" "${args[@]}"
    "$BIN" "${args[@]}" >>"$T/ssdcache-wb.log" 2>&1 &
    WB_PID=$!
    STARTED_PIDS+=("$WB_PID")
    wait_socket "$WB_PID" "$WB_SOCK" || { tail -20 "$T/ssdcache-wb.log" >&2; die "ssdcache serve (write-back) did not start"; }
}
wb_stop() {
    stop_pid "$WB_PID"; forget_pid "$WB_PID"; WB_PID=""
    discard_cache "$WB_CACHE"   # the backlog is still dirty; the next scenario starts from a fresh cache
}
wb_stats() { "$BIN" stats --cache "$WB_CACHE" --control "$WB_CTL" --json 2>/dev/null || echo ""; }
wb_fio() { # OUT.json fio-args...   (the URI is logged as URI)
    local out=$1; shift
    note_cmd_once fio "${@/#--uri=*/--uri=URI}" --output-format=json --output=RESULT.json
    fio "$@" --output-format=json --output="$out" >/dev/null 2>>"$WRES/fio.stderr" || die "fio failed (see $out)"
}

# wb_scenario NAME LABEL BACKLOG(0|1) FLUSH(0|1) [serve args...]
wb_scenario() {
    local name=$1 label=$2 backlog=$3 flush=$4; shift 4
    local p="$WRES/lat-$name" s0 s1 t0 t1 fpid="" frc="" fdone=""
    log "write-back latency: $label"
    wb_start "$@"
    # Warm the working set as hdd.sh's warm-up does: 64 KiB reads in random order, QD32, capped.
    wb_fio "$p.warmup.json" --name=warmup --ioengine=nbd "--uri=$WB_URI" --rw=randread --bs=64k --iodepth=32 \
        --offset=0 --size="${WB_WS_MIB}m" --runtime="$WB_WARM_CAP" --randrepeat=0
    if [ "$backlog" = 1 ]; then
        # Dirty backlog: distinct random 4 KiB blocks of another region, absorbed by the cache.
        wb_fio "$p.backlog.json" --name=backlog --ioengine=nbd "--uri=$WB_URI" --rw=randwrite --bs=4k --iodepth=32 \
            --offset="${BACKLOG_OFFSET_MIB}m" --size="${BACKLOG_REGION_MIB}m" --io_size="${BACKLOG_MIB}m" --randrepeat=0
    fi
    s0=$(wb_stats)
    t0=$(now)
    if [ "$flush" = 1 ]; then
        note_once "$(show_cmd "$BIN" flush --cache "$WB_CACHE" --control "$WB_CTL") &   # during the measured fio run"
        "$BIN" flush --cache "$WB_CACHE" --control "$WB_CTL" 2>"$p.flush.log" &
        fpid=$!
        STARTED_PIDS+=("$fpid")
    fi
    wb_fio "$p.fio.json" --name=zipf "${ZIPF_ARGS[@]}" --time_based --runtime="$HDD_RUNTIME" --ramp_time="$WB_RAMP" \
        --percentile_list=$PCT_LIST --ioengine=nbd "--uri=$WB_URI" --offset=0 --size="${WB_WS_MIB}m"
    t1=$(now)
    s1=$(wb_stats)
    if [ -n "$fpid" ]; then
        if kill -0 "$fpid" 2>/dev/null; then
            fdone=0; stop_pid "$fpid"      # SIGTERM: the flush stops the daemon's drain and exits
        else
            fdone=1; wait "$fpid" && frc=0 || frc=$?
        fi
        forget_pid "$fpid"
    fi
    python3 - "$p.meta.json" "$name" "$label" "$backlog" "$flush" "$s0" "$s1" "$t0" "$t1" "$fdone" "$frc" <<'EOF'
import json, sys
path, name, label, backlog, flush, s0, s1, t0, t1, fdone, frc = sys.argv[1:]
m = dict(name=name, label=label, backlog=backlog == "1", flush=flush == "1", wall_s=float(t1) - float(t0))
if fdone:
    m["flush_finished_during_run"] = fdone == "1"
    m["flush_rc"] = int(frc) if frc else None
if s0 and s1:
    v0, v1 = json.loads(s0)["volumes"][0], json.loads(s1)["volumes"][0]
    for k, v in v1.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(v0.get(k), (int, float)):
            m["d_" + k] = v - v0[k]
    m["dirty_bytes_start"], m["dirty_bytes_end"] = v0["dirty_bytes"], v1["dirty_bytes"]
    r = m.get("d_reads", 0)
    m["hit_ratio"] = m.get("d_read_hits", 0) / r if r else None
json.dump(m, open(path, "w"))
EOF
    python3 - "$p.fio.json" "$p.meta.json" <<'EOF' >&2
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]; m = json.load(open(sys.argv[2]))
r, w = j["read"], j["write"]
p = lambda d, k: d["clat_ns"]["percentile"][k] / 1000
print(f"    {m['name']:<9} {r['iops'] + w['iops']:>7.0f} IOPS  read p50/p99 {p(r, '50.000000'):,.0f}/{p(r, '99.000000'):,.0f} us  "
      f"write p50/p99 {p(w, '50.000000'):,.0f}/{p(w, '99.000000'):,.0f} us  cleaned {m.get('d_bytes_cleaned', 0) / 2**20:.1f} MiB "
      f"in {m['wall_s']:.1f} s  dirty {m.get('dirty_bytes_start', 0) / 2**20:.0f} -> {m.get('dirty_bytes_end', 0) / 2**20:.0f} MiB")
EOF
    wb_stop
}

wb_scenario baseline "baseline: no dirty backlog (writeback-max-age 30 s: the zipf writes stay dirty)" 0 0
wb_scenario paced "aged backlog, cleaner at its own pace (--writeback-max-age 1)" 1 0 --writeback-max-age 1
wb_scenario urgent "backlog written back by ssdcache flush (full speed) during the run" 1 1
rm -f "$WB_CACHE"

python3 - "$WRES/env.json" <<EOF
import json, sys
json.dump(dict(quick=$QUICK, backing_size=$WB_BACKING_SIZE, scattered_bytes=$SCAT_BYTES, scattered_cache=$SCAT_CACHE,
               naive_sample=$NAIVE_SAMPLE, dense_bytes=$DENSE_BYTES, dense_cache=$DENSE_CACHE,
               recovery_cache=$REC_CACHE, lat_cache_mib=$WB_CACHE_MIB, lat_line=$WB_LINE, lat_ws_mib=$WB_WS_MIB,
               lat_runtime=$HDD_RUNTIME, lat_ramp=$WB_RAMP, lat_warm_cap=$WB_WARM_CAP,
               backlog_offset_mib=$BACKLOG_OFFSET_MIB, backlog_region_mib=$BACKLOG_REGION_MIB,
               backlog_mib=$BACKLOG_MIB), open(sys.argv[1], "w"))
EOF
