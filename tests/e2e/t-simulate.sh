#!/usr/bin/env bash
# simulate and advise on traces: libCacheSim's miss ratios (LRU, ARC, S3-FIFO at 10% of the
# footprint), CSV/JSON/SVG outputs, the write-back byte accounting, advise's answer checked
# against simulate's curve, and the whole loop a user runs: record a workload with
# `serve --record-trace`, then simulate and advise on the recording. Bad input gets an error
# naming the file. The trace checks run on the synthetic traces of bench/libcachesim/synthetic
# (hotscan.lis, phases.csv; libCacheSim's values from its synthetic.csv) and, when
# SSDCACHE_TRACES names the shared traces folder, on arc/P3 and the CloudPhysics csv too.
source "$(dirname "$0")/lib.sh"
require_tool qemu-io jq python3 truncate
require_bin

# trace_checks LABEL READS SPEC WRITES TARGET
#   READS   a trace of reads; SPEC "lines=N unique=N requests=N lru=M arc=M s3fifo=M": the
#           cache lines at 10% of its footprint, its unique lines and requests, and
#           libCacheSim's miss ratios at that size
#   WRITES  a trace with writes; TARGET a hit ratio advise can reach on it
trace_checks() {
    local label=$1 reads=$2 spec=$3 writes=$4 target=$5
    local unique requests out json adv size policy hit txt
    unique=$(spec_get "$spec" unique)
    requests=$(spec_get "$spec" requests)

    log "$label: simulate against libCacheSim at 10% of the footprint ($spec)"
    ssd simulate --trace "$reads" --policy lru,arc,s3fifo --cache-size 10% --sequential-cutoff 0 \
        --csv >reference.csv
    python3 - reference.csv "$spec" <<'EOF' || fail "$label: simulate differs from libCacheSim ($spec)"
import csv, sys
rows = {r["policy"]: r for r in csv.DictReader(open(sys.argv[1]))}
spec = dict(pair.split("=") for pair in sys.argv[2].split())
for policy in ("lru", "arc", "s3fifo"):
    r, miss = rows[policy], float(spec[policy])
    assert int(r["cache_lines"]) == int(spec["lines"]), r
    got = 1 - float(r["hit_ratio"])
    assert abs(got - miss) <= 0.002, f"{policy}: miss ratio {got:.4f}, libCacheSim {miss}"
print("reference points match")
EOF

    log "$label: simulate: table, JSON and plot"
    out=$(ssd simulate --trace "$reads" --policy lru,s3fifo --cache-size 1%,10%,50% --plot reads.svg)
    assert_contains "$out" "($unique unique lines)" "simulate table header"
    assert_contains "$out" "s3fifo" "simulate table rows"
    python3 -c 'import sys, xml.dom.minidom as m; d = m.parse(sys.argv[1]); t = d.toxml(); assert "lru" in t and "s3fifo" in t' reads.svg \
        || fail "reads.svg is not a well-formed SVG naming both policies"
    json=$(ssd simulate --trace "$reads" --policy lru --cache-size 10% --json)
    assert_eq "$(jq '.rows | length' <<<"$json")" 1 "JSON rows"
    assert_eq "$(jq '.summary.requests' <<<"$json")" "$requests" "JSON request count"

    log "$label: simulate: write-back accounting on a trace with writes"
    ssd simulate --trace "$writes" --policy lru --cache-size 10%,50% --mode write-back \
        --admission always,2-hit --csv >writes.csv
    python3 - writes.csv <<'EOF' || fail "$label: write-back rows inconsistent"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 4, rows
for r in rows:
    assert int(r["write_refs"]) > 0 and float(r["write_hit_ratio"]) > 0, r
    assert int(r["backing_bytes_written"]) > 0, r
big = {r["admission"]: r for r in rows if r["cache_bytes"] == max(x["cache_bytes"] for x in rows)}
# 2-hit keeps one-hit wonders off the SSD: fewer cache writes, at some cost in hits.
assert int(big["2-hit"]["cache_bytes_written"]) < int(big["always"]["cache_bytes_written"]), big
assert int(big["2-hit"]["not_admitted_refs"]) > 0 and int(big["always"]["not_admitted_refs"]) == 0, big
print("write-back rows consistent")
EOF

    log "$label: simulate: the dirty limit and a slow cleaner (write-back model)"
    ssd simulate --trace "$writes" --policy lru --cache-size 50% --mode write-back \
        --dirty-limit 10 --writeback-rate 4KiB --csv >limited.csv
    python3 - limited.csv <<'EOF' || fail "$label: the dirty limit was not kept"
import csv, sys
(r,) = list(csv.DictReader(open(sys.argv[1])))
lines = int(r["cache_lines"])
assert float(r["peak_dirty_share"]) <= 0.10 + 1.0 / lines, r
assert int(r["written_around_refs"]) > 0, r
assert int(r["overwrite_refs"]) <= int(r["write_refs"]), r
print("dirty limit kept: peak", r["peak_dirty_share"], "around", r["written_around_refs"])
EOF
    table=$(ssd simulate --trace "$writes" --policy lru --cache-size 50% --mode write-back)
    assert_contains "$table" "absorbed%" "the write-back table"

    log "$label: advise: the size it names reaches $target in simulate"
    adv=$(ssd advise --trace "$writes" --target-hit-ratio "$target" --capacity 4TB --ssd-tbw 600 --json)
    size=$(jq -r '.recommended.cache_bytes' <<<"$adv")
    [[ "$size" =~ ^[0-9]+$ ]] || fail "advise named no size: $adv"
    policy=$(jq -r '.policy' <<<"$adv")
    hit=$(ssd simulate --trace "$writes" --policy "$policy" --cache-size "$size" --json | jq '.rows[0].hit_ratio')
    python3 -c "import sys; assert float(sys.argv[1]) >= float(sys.argv[2]), sys.argv[1]" "$hit" "$target" \
        || fail "simulate at $size gives $hit < $target"
    python3 - "$adv" <<'EOF' || fail "advise's endurance or cost is inconsistent: $adv"
import json, sys
a = json.loads(sys.argv[1])
e, c = a["endurance"], a["cost"]
assert e["tbw_bytes"] == 600e12 and not e["tbw_assumed"]
assert e["ssd_bytes_written_per_day"] > 0 and e["lifetime_years"] > 0
assert abs(c["all_flash"] - 4 * 60) < 1e-6 and c["hybrid"] < c["all_flash"]
EOF
    txt=$(ssd advise --trace "$writes" --target-hit-ratio 0.99)
    assert_contains "$txt" "No cache reaches a hit ratio of 0.990" "advise with an unreachable target"
}

synthetic_traces "$TEST_DIR/synthetic"
HOTSCAN="$TEST_DIR/synthetic/hotscan.lis"
spec=$(synthetic_reference hotscan.lis 10)
trace_checks synthetic "$HOTSCAN" "$spec requests=$(wc -l <"$HOTSCAN")" "$TEST_DIR/synthetic/phases.csv" 0.25

TRACES=$(shared_traces_dir)
if [[ -n "$TRACES" ]]; then
    P3=$(shared_trace "$TRACES" arc/P3.lis.zst)
    CP=$(shared_trace "$TRACES" cloudphysics/cloudPhysicsIO.csv)
    # shared/traces/README.md: libCacheSim on arc/P3 at 10% (10,234 of 102,348 blocks).
    trace_checks shared "$P3" "lines=10234 unique=102348 requests=238578 lru=0.7350 arc=0.6210 s3fifo=0.5840" \
        "$CP" 0.25
else
    log "SSDCACHE_TRACES is not set: the checks on the shared traces did not run"
fi

log "record a workload with serve --record-trace, then simulate and advise on it"
mk_sparse backing.img 256M
mk_sparse cache.img 64M
create_cache cache.img backing.img --name vol0 --mode write-through
start_server "$TEST_DIR/nbd.sock" --cache cache.img --record-trace "$TEST_DIR/rec.trace"
URI=$(nbd_uri "$SOCK")
# 64 distinct 4 KiB blocks, each read 3 times: 192 reads, footprint 256 KiB, 128 re-references.
cmds=()
for pass in 1 2 3; do
    for i in $(seq 0 63); do cmds+=(-c "read $((i * 1024 * 1024)) 4k"); done
done
qemu-io -f raw "$URI" "${cmds[@]}" >/dev/null
stop_server
head -1 rec.trace | grep -qx '# ssdcache-trace v1' || fail "rec.trace header: $(head -3 rec.trace)"
json=$(ssd simulate --trace rec.trace --policy lru --cache-size 1MiB --sequential-cutoff 0 --json)
assert_eq "$(jq -r '.format' <<<"$json")" ssdcache "recorded trace format detected"
assert_eq "$(jq '.summary.requests' <<<"$json")" 192 "recorded requests"
assert_eq "$(jq '.summary.unique_lines' <<<"$json")" 64 "recorded footprint in lines"
assert_eq "$(jq '.rows[0].read_refs' <<<"$json")" 192 "line references"
python3 -c "import sys; assert abs(float(sys.argv[1]) - 128/192) < 1e-9, sys.argv[1]" \
    "$(jq '.rows[0].hit_ratio' <<<"$json")" || fail "recorded trace: hit ratio is not 128/192"
adv=$(ssd advise --trace rec.trace --policy lru --target-hit-ratio 0.6 --json)   # a loop: LRU needs every line
assert_eq "$(jq '.recommended.cache_bytes' <<<"$adv")" $((256 * 1024)) "advise (LRU) on the recorded loop: all 64 lines"

log "bad input: errors name the file"
printf 'not,a,trace\n' >bad.csv
expect_fail_stderr "simulate on a file of no known format" 'bad\.csv' "$SSDCACHE_BIN" simulate --trace bad.csv
expect_fail_stderr "simulate with a missing file" 'nonexistent\.trace' "$SSDCACHE_BIN" simulate --trace nonexistent.trace
printf '1 8 0 0\n2 8 0 1\nthree 8 0 2\n' >cut.lis
expect_fail_stderr "arc trace with a bad line" 'cut\.lis.*line 3' "$SSDCACHE_BIN" simulate --trace cut.lis --format arc
expect_fail_stderr "unknown policy" 'unknown policy' "$SSDCACHE_BIN" simulate --trace "$HOTSCAN" --policy lfu-ish
expect_fail_stderr "bad target" 'above 0 and below 1' "$SSDCACHE_BIN" advise --trace "$HOTSCAN" --target-hit-ratio 1.5
log "PASS"
