# bench/hdd.sh: section 2 of bench/run (sourced by it, not run on its own).
#
# The cache in front of a hard drive: the HDD model raw, nbdkit's cache filter
# over it, ssdcache --emulate-hdd in each mode (write-back included). Uses from
# bench/run: $BIN $T $RES $BACKING (first $WORKING_SET_MIB MiB written),
# run/note_cmd_once, discard_cache, wait_socket, stop_pid, forget_pid,
# STARTED_PIDS, log, die, $QUICK, PCT_LIST, ZIPF_ARGS, $TRACES_DIR, $SYNTHETIC.
#
# Results: $RES/hdd/CELL.fio.json + CELL.meta.json per measurement, the trace
# iolog, the warm-up curve samples, env.json.

HDD_CACHE_MIB=512                       # ssdcache data area = nbdkit cache-max-size
WS_IN_MIB=256                           # working set inside the cache
WS_OUT_MIB=$((2 * HDD_CACHE_MIB))       # working set twice the cache
[ "$WS_OUT_MIB" -le "$WORKING_SET_MIB" ] || die "backing data region smaller than the large working set"
HDD_RAMP=1
WARM_CAP=$((4 * HDD_RUNTIME))           # ssdcache warm-up pass cap (s)
WARM_SEED=randrepeat0                   # warm-up's seeding (recorded: runs differing here differ in warm cells)
SEQ_CAP=10                              # sequential cells: one pass over the working set, capped (s)
# The replayed trace: $TRACE_FILE, else MQSim's TPC-C trace from the shared traces
# (SSDCACHE_TRACES), else the synthetic phases trace bench/run wrote (55% writes).
if [ -z "${TRACE_FILE:-}" ]; then
    if [ -n "$TRACES_DIR" ]; then TRACE_FILE=$TRACES_DIR/mqsim/tpcc-small.trace; else TRACE_FILE=$SYNTHETIC/phases.disksim; fi
fi
[ -f "$TRACE_FILE" ] || die "trace $TRACE_FILE is missing"
if [ "$QUICK" = 1 ]; then
    TRACE_N=400 TRACE_CAP=4 CURVE_S=6
    TARGETS=(hdd nbdkit ssd-wt ssd-wb)
else
    TRACE_N=2000 TRACE_CAP=12 CURVE_S=30
    TARGETS=(hdd nbdkit ssd-wt ssd-wb ssd-wa ssd-pt)
fi
# randwrite last: in a warm run it follows the others, whose cells it would otherwise change.
WORKLOADS=(db zipf seqread seqwrite randwrite)
# Cells skipped in --quick (a CI smoke run): everything but the database model and
# random writes inside the cache (cold, warm) and cold sequential reads of the large set.
quick_skip() { # workload ws state
    [ "$QUICK" = 1 ] || return 1
    case "$1/$2/$3" in
        db/in/*|randwrite/in/*|seqread/out/cold|seqread/out/any) return 1 ;;
    esac
    return 0
}

HRES="$RES/hdd"
mkdir -p "$HRES"
HDD_CACHE="$T/hdd-cache.img"
HDD_SOCK="$T/hdd.sock" NK_SOCK="$T/nbdkit-cache.sock" NK_TMP="$T/nbdkit-tmp"
SC_SOCK="$T/ssdcache-hdd.sock" SC_CTL="$T/ssdcache-hdd.ctl"
HDD_URI="nbd+unix:///hdd?socket=$HDD_SOCK"

echo "# section 2: the cache in front of the HDD model" >>"$CMDLOG"
# Cache file: 512 MiB of cache lines plus ssdcache's metadata (6 MiB at this size).
run fio --name=fill-hdd-cache --filename="$HDD_CACHE" --rw=write --bs=1m --size=$((HDD_CACHE_MIB + 6))m \
    --direct=1 --ioengine=libaio --iodepth=8 --output=/dev/null
"$BIN" create --cache "$HDD_CACHE" --backing "$BACKING" --mode write-through --name hdd --force >/dev/null
"$BIN" info --cache "$HDD_CACHE" --json >"$HRES/info.json"
python3 - "$HRES/info.json" "$HDD_CACHE_MIB" <<'EOF' || die "the HDD-section cache does not hold exactly the intended data area"
import json, sys
i = json.load(open(sys.argv[1]))
assert i["lines"] * i["line_size"] == int(sys.argv[2]) << 20, (i["lines"], i["line_size"])
EOF

# The trace, as a fio iolog (v2), 4 KiB aligned, folded into the data region.
run python3 "$BENCH/trace2iolog.py" "$TRACE_FILE" --requests "$TRACE_N" \
    --region $((WS_OUT_MIB << 20)) --out "$HRES/trace.iolog" --summary "$HRES/trace.json"

TPID="" HPID="" TURI="" TCUR=""
start_hdd() {
    rm -f "$HDD_SOCK"
    local args=(hdd-emulator --file "$BACKING" --socket "$HDD_SOCK")
    note_cmd_once "$BIN" "${args[@]}"
    "$BIN" "${args[@]}" >>"$T/hdd-emulator.log" 2>&1 &
    HPID=$!
    STARTED_PIDS+=("$HPID")
    wait_socket "$HPID" "$HDD_SOCK" || { tail -20 "$T/hdd-emulator.log" >&2; die "hdd-emulator did not start"; }
}
start_target() { # hdd | nbdkit | ssd-wt | ssd-wb | ssd-wa | ssd-pt   (always cold: fresh cache)
    TCUR=$1
    case "$1" in
        hdd)
            start_hdd; TPID=$HPID; TURI=$HDD_URI ;;
        nbdkit)
            start_hdd
            rm -rf "$NK_TMP"; mkdir -p "$NK_TMP"; rm -f "$NK_SOCK"
            local args=(env "TMPDIR=$NK_TMP" nbdkit --unix "$NK_SOCK" --foreground --filter=cache
                        nbd "socket=$HDD_SOCK" export=hdd cache=writethrough cache-on-read=true
                        "cache-max-size=${HDD_CACHE_MIB}M")
            note_cmd_once "${args[@]}"
            "${args[@]}" >>"$T/nbdkit-cache.log" 2>&1 &
            TPID=$!
            STARTED_PIDS+=("$TPID")
            wait_socket "$TPID" "$NK_SOCK" || { tail -20 "$T/nbdkit-cache.log" >&2; die "nbdkit --filter=cache did not start"; }
            TURI="nbd+unix:///?socket=$NK_SOCK" ;;
        ssd-*)
            local mode
            case "$1" in
                ssd-wt) mode=write-through ;; ssd-wb) mode=write-back ;;
                ssd-wa) mode=write-around ;; ssd-pt) mode=pass-through ;;
            esac
            note_cmd_once "$BIN" create --cache "$HDD_CACHE" --backing "$BACKING" --mode "$mode" --name hdd --force
            "$BIN" create --cache "$HDD_CACHE" --backing "$BACKING" --mode "$mode" --name hdd --force >/dev/null ||
                die "ssdcache create failed"
            rm -f "$SC_SOCK"
            local args=(serve --cache "$HDD_CACHE" --socket "$SC_SOCK" --control "$SC_CTL" --emulate-hdd)
            note_cmd_once "$BIN" "${args[@]}"
            "$BIN" "${args[@]}" >>"$T/ssdcache-hdd.log" 2>&1 &
            TPID=$!
            STARTED_PIDS+=("$TPID")
            wait_socket "$TPID" "$SC_SOCK" || { tail -20 "$T/ssdcache-hdd.log" >&2; die "ssdcache serve --emulate-hdd did not start"; }
            TURI="nbd+unix:///?socket=$SC_SOCK" ;;
    esac
}
stop_target() {
    local p
    for p in $TPID $HPID; do stop_pid "$p"; forget_pid "$p"; done
    # write-back: the stopped cache still holds dirty data; the next cell starts from a fresh one
    [ "$TCUR" != ssd-wb ] || discard_cache "$HDD_CACHE"
    TPID="" HPID="" TCUR=""
}
sc_stats() { "$BIN" stats --cache "$HDD_CACHE" --control "$SC_CTL" --json 2>/dev/null || echo ""; }

wl_args() { # workload ws_mib
    local common=(--ioengine=nbd "--uri=$TURI" --offset=0 "--size=$2m" --output-format=json)
    case "$1" in
        db) echo --name=db --rw=randrw --rwmixread=75 --bs=4k --iodepth=64 --numjobs=1 --norandommap \
                 --time_based --runtime="$HDD_RUNTIME" --ramp_time="$HDD_RAMP" --percentile_list=$PCT_LIST "${common[@]}" ;;
        zipf) echo --name=zipf "${ZIPF_ARGS[@]}" \
                 --time_based --runtime="$HDD_RUNTIME" --ramp_time="$HDD_RAMP" --percentile_list=$PCT_LIST "${common[@]}" ;;
        seqread) echo --name=seqread --rw=read --bs=1m --iodepth=8 --runtime="$SEQ_CAP" "${common[@]}" ;;
        seqwrite) echo --name=seqwrite --rw=write --bs=1m --iodepth=8 --runtime="$SEQ_CAP" "${common[@]}" ;;
        randwrite) echo --name=randwrite --rw=randwrite --bs=4k --iodepth=32 --numjobs=1 --norandommap \
                 --time_based --runtime="$HDD_RUNTIME" --ramp_time="$HDD_RAMP" --percentile_list=$PCT_LIST "${common[@]}" ;;
    esac
}
warmup() { # target ws_mib out.json: fill the cache with the working set
    # ssdcache: 64 KiB reads (one line each) in random order, QD32, each line once, capped
    # at WARM_CAP s. Not a sequential pass, nor large reads: ssdcache's stream detector
    # (create --sequential-cutoff, default 4 MiB; a request within 1 MiB + 8 lengths of a
    # tracked stream continues it) deliberately sends those to the backing device.
    # nbdkit's cache filter: one sequential 1 MiB pass (it serialises misses, so the
    # random 64 KiB pass would take minutes; it has no stream detection).
    local args
    if [ "$1" = nbdkit ]; then
        args=(--name=warmup --ioengine=nbd "--uri=$TURI" --rw=read --bs=1m --iodepth=8 --offset=0 "--size=$2m")
    else
        # --randrepeat=0: fio (3.33) otherwise seeds every job's offsets alike (even with
        # --randseed), so the measured cell's random offsets would follow the warm-up's order
        # and a partial warm-up (the 1 GiB set) would have cached exactly the blocks read first.
        args=(--name=warmup --ioengine=nbd "--uri=$TURI" --rw=randread --bs=64k --iodepth=32 --offset=0 "--size=$2m"
              --runtime="$WARM_CAP" --randrepeat=0)
    fi
    note_cmd_once fio "${args[@]/#--uri=*/--uri=URI}" --output-format=json --output=WARMUP.json
    fio "${args[@]}" --output-format=json --output="$3" >/dev/null || die "warm-up pass failed"
}

# hdd_measure CELL TARGET WORKLOAD WS(in|out) STATE FIO-ARGS...
hdd_measure() {
    local cell=$1 target=$2 wl=$3 ws=$4 state=$5; shift 5
    local out="$HRES/$cell.fio.json" s0="" s1="" t0 t1
    [ "${target#ssd-}" != "$target" ] && s0=$(sc_stats)
    note_cmd_once fio "${@/#--uri=*/--uri=URI}" --output=RESULT.json
    # ssdcache's counters also when fio's ramp ends, for the measured window alone (the share
    # of writes the cache absorbed: the ramp of a cold cell fills empty lines).
    local ramp_stats="$HRES/$cell.stats-ramp.json" snap=""
    rm -f "$ramp_stats"
    if [ -n "$s0" ]; then
        ( sleep "$HDD_RAMP"; sc_stats >"$ramp_stats" ) &
        snap=$!
    fi
    t0=$(now)
    fio "$@" --output="$out" >/dev/null 2>>"$HRES/fio.stderr" || die "fio failed: $cell (see $out)"
    t1=$(now)
    [ -z "$snap" ] || wait "$snap" || true
    [ -n "$s0" ] && s1=$(sc_stats)
    python3 - "$HRES/$cell.meta.json" "$cell" "$target" "$wl" "$ws" "$state" "$s0" "$s1" "$t0" "$t1" "$ramp_stats" <<'EOF'
import json, os, sys
path, cell, target, wl, ws, state, s0, s1, t0, t1, ramp = sys.argv[1:]
m = dict(cell=cell, target=target, workload=wl, ws=ws, state=state, wall_s=float(t1) - float(t0))
if s0 and s1:
    v0, v1 = json.loads(s0)["volumes"][0], json.loads(s1)["volumes"][0]
    for k, v in v1.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(v0.get(k), (int, float)):
            m["d_" + k] = v - v0[k]
    try:
        vr = json.load(open(ramp))["volumes"][0]
        written = v1["bytes_written"] - vr["bytes_written"]
        around = v1["bytes_written_around_full"] - vr["bytes_written_around_full"]
        if written > 0:
            # Written to the cache (absorbed at SSD speed), not sent around a cache at its
            # dirty limit, after the ramp.
            m["absorbed_share"] = 1 - around / written
    except (OSError, ValueError, KeyError, IndexError):
        pass
    r = m.get("d_reads", 0)
    m["hit_ratio"] = m.get("d_read_hits", 0) / r if r else None
    for k in ("dirty_bytes", "occupancy_bytes"):  # levels at the end (write-back: dirty left)
        if k in v1:
            m["end_" + k] = v1[k]
json.dump(m, open(path, "w"))
EOF
    python3 - "$out" "$HRES/$cell.meta.json" <<'EOF' >&2
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]; m = json.load(open(sys.argv[2]))
r, w = j["read"], j["write"]
iops = r["iops"] + w["iops"]; mbs = (r["bw_bytes"] + w["bw_bytes"]) / 1e6
h = f"  hits {m['hit_ratio']*100:.1f}%" if m.get("hit_ratio") is not None else ""
print(f"    {m['cell']:<34} {iops:>9.0f} IOPS {mbs:>8.1f} MB/s{h}")
EOF
}

# ---- the matrix. cold: a fresh target per cell. warm: per target and working set one
# fresh target, one warm-up, then the workloads back to back in the order below.
STATELESS=" hdd ssd-pt "      # no cache: measured once per (workload, ws), state "any"
for ws in in out; do
    ws_mib=$WS_IN_MIB; [ "$ws" = out ] && ws_mib=$WS_OUT_MIB
    for target in "${TARGETS[@]}"; do
        if [[ $STATELESS == *" $target "* ]]; then states=(any); else states=(cold warm); fi
        for state in "${states[@]}"; do
            started=0
            for wl in "${WORKLOADS[@]}"; do
                quick_skip "$wl" "$ws" "$state" && continue
                log "HDD section: $target $wl ws=$ws ($ws_mib MiB) $state"
                if [ "$state" != warm ] || [ "$started" = 0 ]; then
                    start_target "$target"
                    if [ "$state" = warm ]; then
                        [ "${target#ssd-}" != "$target" ] && sc_stats >"$HRES/$target.$ws.warmup.stats0.json"
                        warmup "$target" "$ws_mib" "$HRES/$target.$ws.warmup.json"
                        [ "${target#ssd-}" != "$target" ] && sc_stats >"$HRES/$target.$ws.warmup.stats1.json"
                    fi
                    started=1
                fi
                read -ra FIO_ARGS <<<"$(wl_args "$wl" "$ws_mib")"
                hdd_measure "$target.$wl.$ws.$state" "$target" "$wl" "$ws" "$state" "${FIO_ARGS[@]}"
                [ "$state" = warm ] || stop_target
            done
            [ "$state" != warm ] || stop_target
        done
    done
done

# ---- trace replay: cold (fresh target), then the same requests again (warm)
for target in "${TARGETS[@]}"; do
    log "HDD section: trace replay on $target"
    start_target "$target"
    for state in cold warm; do
        hdd_measure "$target.trace.out.$state" "$target" trace out "$state" \
            --name=trace --ioengine=nbd "--uri=$TURI" --read_iolog="$HRES/trace.iolog" --replay_no_stall=1 \
            --iodepth=16 --runtime="$TRACE_CAP" --percentile_list=$PCT_LIST --output-format=json
    done
    stop_target
done

# ---- warm-up curve: cold database model on write-through, stats every second
log "HDD section: warm-up curve (${CURVE_S} s cold database model on ssdcache write-through)"
start_target ssd-wt
(
    while :; do
        s=$("$BIN" stats --cache "$HDD_CACHE" --control "$SC_CTL" --json 2>/dev/null | tr -d '\n') || s=""
        [ -n "$s" ] && printf '%s %s\n' "$(date +%s.%N)" "$s"
        sleep 1
    done
) >"$HRES/curve.stats.jsonl" &
SAMPLER=$!
STARTED_PIDS+=("$SAMPLER")
note_cmd_once "while :; do date +%s.%N; ssdcache stats --cache \$T/hdd-cache.img --control \$T/ssdcache-hdd.ctl --json; sleep 1; done &"
echo "$(now)" >"$HRES/curve.start"
read -ra FIO_ARGS <<<"$(wl_args db "$WS_IN_MIB" | sed "s/--runtime=$HDD_RUNTIME /--runtime=$CURVE_S /; s/--ramp_time=$HDD_RAMP /--ramp_time=0 /")"
hdd_measure "curve" ssd-wt db in cold "${FIO_ARGS[@]}" --write_iops_log="$HRES/curve" --log_avg_msec=1000
kill "$SAMPLER" 2>/dev/null || true; wait "$SAMPLER" 2>/dev/null || true; forget_pid "$SAMPLER"
stop_target

python3 - "$HRES/env.json" <<EOF
import json, sys
json.dump(dict(cache_mib=$HDD_CACHE_MIB, ws_in_mib=$WS_IN_MIB, ws_out_mib=$WS_OUT_MIB,
               backing_size="$BACKING_SIZE", runtime=$HDD_RUNTIME, ramp=$HDD_RAMP, seq_cap=$SEQ_CAP,
               trace="$TRACE_FILE", trace_n=$TRACE_N, trace_cap=$TRACE_CAP, curve_s=$CURVE_S,
               targets="${TARGETS[*]}".split(), quick=$QUICK, warm_cap=$WARM_CAP, warm_seed="$WARM_SEED"), open(sys.argv[1], "w"))
EOF
